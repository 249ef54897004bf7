"""traces.WriteBehind: samples committed on a background thread hold what TraceWriter writes inline, the queue is
bounded, failures surface on the submitting thread, and an interrupted run commits what it had decoded."""

from __future__ import annotations

import threading

import pyarrow.parquet as pq
import pytest

from traces import TraceFormatError, TraceWriter, WriteBehind, open_run
from traces.example import example_manifest, example_sample
from traces.layout import list_parts, part_path

IDS = [f"gsm8k/test/{i:04d}" for i in range(6)]


def parts(sample_id: str, seed: int) -> dict:
    return example_sample(sample_id, prompt_tokens=37, generated_tokens=21, n_layers=6, seed=seed, movements=True)


def written_tables(path) -> dict[tuple[str, str], object]:
    run = open_run(path)
    return {(table, sid): pq.read_table(part_path(run.path, table, sid))
            for sid in run.sample_ids() for table in ("samples", "steps", "tokens", "access")}


def test_committed_behind_equals_written_inline(tmp_path):
    with TraceWriter(tmp_path / "inline", example_manifest(sample_ids=IDS)) as writer:
        for i, sid in enumerate(IDS):
            writer.write_sample(**parts(sid, i))
    with WriteBehind(TraceWriter(tmp_path / "behind", example_manifest(sample_ids=IDS)), depth=2) as behind:
        for i, sid in enumerate(IDS):
            behind.submit(**parts(sid, i))
    inline, behind_tables = written_tables(tmp_path / "inline"), written_tables(tmp_path / "behind")
    assert sorted(inline) == sorted(behind_tables) and len(inline) == 4 * len(IDS)
    for key, table in inline.items():
        assert behind_tables[key].equals(table), key
    open_run(tmp_path / "behind").validate()


class GatedWriter(TraceWriter):
    """Commits only when the test opens the gate (one sample per `release`), and can fail a chosen sample."""

    def __init__(self, *args, fail_on: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.started, self.fail_on = threading.Semaphore(0), threading.Semaphore(0), fail_on

    def commit_sample(self, prepared) -> None:
        self.started.release()
        assert self.gate.acquire(timeout=30), "the test never released this commit"
        if prepared[0] == self.fail_on:
            raise OSError(28, "No space left on device")
        super().commit_sample(prepared)


def test_queue_is_bounded_and_submit_waits_for_room(tmp_path):
    writer = GatedWriter(tmp_path / "run", example_manifest(sample_ids=IDS))
    behind = WriteBehind(writer, depth=1)
    behind.submit(**parts(IDS[0], 0))
    assert writer.started.acquire(timeout=30)  # the first is being committed (held at the gate)
    behind.submit(**parts(IDS[1], 1))  # the one queued slot
    third = threading.Thread(target=behind.submit, kwargs=parts(IDS[2], 2))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # no room: it waits for the writer
    assert not list_parts(writer.path, "samples")
    for _ in range(3):
        writer.gate.release()
    third.join(timeout=30)
    assert not third.is_alive()
    behind.close()
    assert open_run(writer.path).sample_ids() == IDS[:3]


def test_failure_on_the_thread_surfaces_on_the_next_submit_and_keeps_earlier_samples(tmp_path):
    writer = GatedWriter(tmp_path / "run", example_manifest(sample_ids=IDS), fail_on=IDS[1])
    behind = WriteBehind(writer, depth=2)
    behind.submit(**parts(IDS[0], 0))
    assert writer.started.acquire(timeout=30)  # held at the gate, so the failure cannot surface before all three
    behind.submit(**parts(IDS[1], 1))
    behind.submit(**parts(IDS[2], 2))  # queued behind the failure: dropped, decoded again on resume
    for _ in range(3):
        writer.gate.release()
    with pytest.raises(OSError, match="No space left"):
        behind.close()
    with pytest.raises(OSError, match="No space left"):
        behind.submit(**parts(IDS[3], 3))
    run = open_run(writer.path)
    assert run.sample_ids() == [IDS[0]]
    run.validate()
    with TraceWriter(writer.path, example_manifest(sample_ids=IDS)) as resumed:  # the resume still works
        assert resumed.done_sample_ids() == {IDS[0]}
        resumed.write_sample(**parts(IDS[1], 1))
    assert open_run(writer.path).sample_ids() == IDS[:2]


def test_bad_rows_raise_in_submit_and_duplicates_are_refused(tmp_path):
    with WriteBehind(TraceWriter(tmp_path / "run", example_manifest(sample_ids=IDS))) as behind:
        bad = parts(IDS[0], 0)
        bad["steps"] = {k: v for k, v in bad["steps"].items() if k != "hbm_tokens"}
        with pytest.raises(TraceFormatError, match="hbm_tokens"):
            behind.submit(**bad)  # checked on the caller's thread, nothing queued
        behind.submit(**parts(IDS[0], 0))
        with pytest.raises(TraceFormatError, match="already"):
            behind.submit(**parts(IDS[0], 0))
    assert open_run(tmp_path / "run").sample_ids() == [IDS[0]]


def test_an_interrupted_run_commits_what_it_queued_and_keeps_the_interrupt(tmp_path):
    writer = GatedWriter(tmp_path / "run", example_manifest(sample_ids=IDS))
    for _ in range(len(IDS)):
        writer.gate.release()
    with pytest.raises(KeyboardInterrupt), WriteBehind(writer, depth=3) as behind:
        for i, sid in enumerate(IDS[:3]):
            behind.submit(**parts(sid, i))
        raise KeyboardInterrupt
    assert open_run(writer.path).sample_ids() == IDS[:3]


def test_a_bad_access_table_fails_behind_and_leaves_no_part_of_its_sample(tmp_path):
    behind = WriteBehind(TraceWriter(tmp_path / "run", example_manifest(sample_ids=IDS)))
    behind.submit(**parts(IDS[0], 0))
    bad = parts(IDS[1], 1)
    bad["access"] = {k: v for k, v in bad["access"].items() if k != "layer"}  # its masses are encoded behind
    behind.submit(**bad)
    with pytest.raises(TraceFormatError, match="layer"):
        behind.close()
    run = open_run(tmp_path / "run")
    assert run.sample_ids() == [IDS[0]]
    assert not any(part_path(run.path, table, IDS[1]).exists() for table in ("steps", "tokens", "access", "samples"))


def test_without_a_thread_submit_commits_before_it_returns(tmp_path):
    with WriteBehind(TraceWriter(tmp_path / "run", example_manifest(sample_ids=IDS)), background=False) as behind:
        for i, sid in enumerate(IDS[:2]):
            behind.submit(**parts(sid, i))
            assert open_run(tmp_path / "run").sample_ids() == IDS[: i + 1]


def test_thoughtkv_trace_writes_behind_what_it_writes_inline(tmp_path, monkeypatch):
    """run_trace's GPU path (a writer thread), forced on the CPU, commits the same rows as its inline CPU path."""
    import traces
    from tracer.run import TraceConfig, run_trace

    class Behind(WriteBehind):
        threads: list = []

        def __init__(self, writer, depth: int = 2, background: bool = False):
            assert background is False  # on a CPU run_trace writes inline ...
            super().__init__(writer, depth=1, background=True)  # ... here on a thread, one sample waiting at most
            Behind.threads.append(self._thread)

    def trace(out, background: bool):
        with monkeypatch.context() as patch:
            if background:
                patch.setattr(traces, "WriteBehind", Behind)
            run_trace(TraceConfig(model="micro", task="chains", out=str(out), policy="hierarchy", hbm_budget=0.3,
                                  batch_size=3, max_new_tokens=24, n_samples=7, threads=1), progress=False)
        return open_run(out)

    inline, behind = trace(tmp_path / "inline", False), trace(tmp_path / "behind", True)
    assert len(Behind.threads) == 1 and Behind.threads[0] is not None and not Behind.threads[0].is_alive()
    assert inline.sample_ids() == behind.sample_ids() and len(inline.sample_ids()) == 7
    behind.validate()
    timing = ["measured_step_us", "measured_layer_us", "measured_deferred_us", "wall_s"]
    for table in ("samples", "steps", "tokens", "access"):
        got, want = (getattr(run, table)() for run in (behind, inline))
        got, want = (frame.drop(columns=[c for c in timing if c in frame]) for frame in (got, want))
        assert got.astype(str).equals(want.astype(str)), table


def test_a_bundled_model_run_resumes_from_another_checkout_and_another_model_does_not(tmp_path):
    """The bundled models are recorded by their directory; a run traced in one checkout (or worktree) resumes in
    another, where the same bundled model lives elsewhere, but never under a different model."""
    import pytest

    from traces import TraceWriter
    from traces.errors import TraceFormatError
    from traces.example import example_manifest

    def manifest(model_id):
        m = example_manifest(sample_ids=["s0"])
        m["model"]["id"] = model_id
        return m

    TraceWriter(tmp_path / "run", manifest("/one/checkout/tracer/assets/micro_long"))
    TraceWriter(tmp_path / "run", manifest("/another/clone/tracer/assets/micro_long"))  # resumes
    for other in ("/another/clone/tracer/assets/micro", "/models/micro_long"):
        with pytest.raises(TraceFormatError, match="cannot resume: model.id"):
            TraceWriter(tmp_path / "run", manifest(other))
