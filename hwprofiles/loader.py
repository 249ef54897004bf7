"""Finding and reading hardware profile files.

A profile is `<name>.yaml` in one of the search directories: the user's `--profiles-dir` (if given), then the
shipped datasheet profiles (`hwprofiles/profiles/`), then measured ones written by calibration
(`hwprofiles/measured/`). A name found in two directories is an error rather than a silent override, so
that a result always says unambiguously which hardware it was simulated on.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hwprofiles.schema import HardwareProfile, ProfileError, profile_from_dict

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
MEASURED_DIR = Path(__file__).resolve().parent / "measured"
YAML_SUFFIXES = (".yaml", ".yml")

# Bounds of any YAML file the project reads as settings (profiles, sweep grids): far above a real one (a
# profile is ~5 KB and ~300 nodes), far below what an alias bomb expands to ("billion laughs": 9 nested lists
# of 9 aliases is 9^9 nodes from a few hundred bytes).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 100_000


def read_yaml_file(path: str | Path, error: type[Exception] = ProfileError, what: str = "a hardware profile"):
    """`yaml.safe_load` of a settings file, bounded: at most MAX_YAML_BYTES, and at most MAX_YAML_NODES nodes
    once every alias is expanded (counted on the composed graph before anything is built, so a bomb is
    refused in microseconds); recursive aliases are refused. Any problem -> `error` with one line."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise error(f"{path}: {size:,} bytes is too large for {what} (at most {MAX_YAML_BYTES:,}); "
                        "check the file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read the file ({type(exc).__name__}); check it is UTF-8 text") from None
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters already (ReaderError)
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_nodes(node)
        if expanded > MAX_YAML_NODES:
            raise error(f"{path}: its aliases expand to more than {MAX_YAML_NODES:,} YAML nodes (an alias bomb?); "
                        f"{what} needs no such thing, write the values out")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise error(f"{path}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise error(f"{path}: YAML nested too deeply to be {what}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _expanded_nodes(root) -> int:
    """Nodes of the document with every alias expanded, without expanding anything: size(n) = 1 + the sizes of
    its children, each shared node computed once. Stops counting (returns > MAX_YAML_NODES) as soon as the
    bound is passed; a node that contains itself raises."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size[key] = min(MAX_YAML_NODES + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in size:
            continue
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise yaml.composer.ComposerError(None, None, "a recursive alias (a node that contains itself)",
                                                  child.start_mark)
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_profile_file(path: str | Path) -> HardwareProfile:
    """Reads and validates one YAML profile file; any problem -> ProfileError naming the file and field."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file; pass an existing .yaml file or a profile name")
    data = read_yaml_file(path)
    profile = profile_from_dict(data, str(path))
    if profile.name != path.stem:
        raise ProfileError(f"{path}: name: {profile.name!r} differs from the file name; rename the file to "
                           f"{profile.name}{path.suffix} or set `name: {path.stem}`")
    return profile


def validate_profile_file(path: str | Path) -> HardwareProfile:
    """Same as `load_profile_file`; the name says why you call it."""
    return load_profile_file(path)


def search_dirs(profiles_dir: str | Path | None = None) -> list[Path]:
    dirs = []
    if profiles_dir is not None:
        user_dir = Path(profiles_dir)
        if not user_dir.is_dir():
            raise ProfileError(f"--profiles-dir {user_dir}: not a directory; pass a directory of <name>.yaml files")
        dirs.append(user_dir)
    dirs += [d for d in (PROFILES_DIR, MEASURED_DIR) if d.is_dir()]
    return dirs


def _profile_files(dirs: list[Path]) -> dict[str, list[Path]]:
    """Profile name (file stem) -> every file that defines it, in search order."""
    by_name: dict[str, list[Path]] = {}
    for directory in dirs:
        for path in sorted(directory.iterdir()):
            if path.suffix in YAML_SUFFIXES and path.is_file():
                known = by_name.setdefault(path.stem, [])
                if all(path.resolve() != p.resolve() for p in known):
                    known.append(path)
    return by_name


def _single(name: str, paths: list[Path]) -> Path:
    if len(paths) > 1:
        raise ProfileError(f"{paths[1]}: profile name {name!r} is also defined in {paths[0]}; rename one of them")
    return paths[0]


def is_path(name_or_path: str | Path) -> bool:
    """A --profile value that names a file (a .yaml name or a path), not a profile to search for."""
    text = str(name_or_path)
    return text.endswith(YAML_SUFFIXES) or "/" in text or "\\" in text


def profile_file(name_or_path: str | Path, profiles_dir: str | Path | None = None) -> Path:
    """The file `load_profile` reads for a name (searched in `profiles_dir`, shipped, measured) or a path."""
    text = str(name_or_path)
    if is_path(text):
        return Path(text)
    by_name = _profile_files(search_dirs(profiles_dir))
    if text not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        raise ProfileError(f"unknown hardware profile {text!r}; known: {known} (or pass a path to a .yaml file)")
    return _single(text, by_name[text])


def load_profile(name_or_path: str | Path, profiles_dir: str | Path | None = None) -> HardwareProfile:
    """A profile by name (searched in `profiles_dir`, shipped, measured) or by path to a .yaml file.

    A file given by path that keeps the name of a profile found by name but differs from it (an edited copy,
    hw2/h100-pcie.yaml) is named after its file, `h100-pcie (file hw2/h100-pcie.yaml)` (`file_label`): results
    say which hardware they were simulated on, and never replace the rows of the profile it was copied from."""
    path = profile_file(name_or_path, profiles_dir)
    profile = load_profile_file(path)
    if is_path(name_or_path):  # given as a file, not found by name
        known = _profile_files(search_dirs(profiles_dir)).get(profile.name, [])
        if known and not any(k.resolve() == path.resolve() or k.read_bytes() == path.read_bytes() for k in known):
            from dataclasses import replace

            profile = replace(profile, name=file_label(profile.name, name_or_path))
    return profile


def file_label(name: str, path: str | Path) -> str:
    """The name results give a profile file that shadows a profile of the same name (see `load_profile`)."""
    return f"{name} (file {path})"


def list_profiles(profiles_dir: str | Path | None = None) -> list[HardwareProfile]:
    """Every profile in the search directories, validated, sorted by name; duplicates are an error."""
    by_name = _profile_files(search_dirs(profiles_dir))
    return [load_profile_file(_single(name, paths)) for name, paths in sorted(by_name.items())]


def contention_note(profile: HardwareProfile) -> str | None:
    """Why a measured profile's timings are not to be trusted by default: `thoughtkv calibrate` recorded that
    other work competed for the CPUs while it measured (provenance.host_facts.contended, load average above the
    usable CPUs); None for an uncontended or datasheet profile."""
    facts = profile.provenance.get("host_facts") or {}
    if facts.get("contended") is not True:
        return None
    return (f"calibrated under CPU contention (load {facts.get('load_avg_1m')} on {facts.get('usable_cpus')} "
            "CPUs): its timings are slower than the machine")


EXAMPLE_PREFIX = "example-"  # a shipped example of a profile kind (hwprofiles/measured/README.md), no real machine


def left_out_reason(profile: HardwareProfile) -> str | None:
    """Why `--all-profiles` leaves a profile out (a user names it to use it anyway): an example's name starts
    with EXAMPLE_PREFIX (it is another machine, shown for what a measured profile holds), or it was calibrated
    under contention (`contention_note`); None for the profiles it means."""
    if profile.name.startswith(EXAMPLE_PREFIX):
        return "an example, not this machine"
    return "calibrated under CPU contention" if contention_note(profile) is not None else None


def default_profiles(profiles_dir: str | Path | None = None) -> tuple[list[HardwareProfile], list[str]]:
    """The set `--all-profiles` (and a sweep's `profiles: all`) means: every profile but examples and those
    calibrated under contention (`left_out_reason`), which a user names explicitly to use; returns (profiles,
    the names left out). A quiet machine cannot be promised where profiles are calibrated (shared CI boxes),
    so the contended mark, recorded by calibrate itself, decides rather than a recalibration."""
    profiles = list_profiles(profiles_dir)
    left_out = [p.name for p in profiles if left_out_reason(p) is not None]
    return [p for p in profiles if p.name not in left_out], left_out
