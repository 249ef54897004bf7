"""thoughtkv_base.markdown: the one Markdown-table writer of the documents."""

from hypothesis import given
from hypothesis import strategies as st

from thoughtkv_base.markdown import markdown_table

CELL = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), max_size=8)


@given(st.lists(CELL, min_size=1, max_size=5).flatmap(
    lambda header: st.tuples(st.just(header), st.lists(st.lists(CELL, min_size=len(header), max_size=len(header)),
                                                       max_size=4))))
def test_every_row_keeps_its_columns(table):
    header, rows = table
    lines = markdown_table(header, rows)
    assert len(lines) == 2 + len(rows) and lines[1] == "|" + "---|" * len(header)
    for line, cells in zip([lines[0], *lines[2:]], [header, *rows]):
        # a cell's own `|` is escaped: splitting on the unescaped ones gives the cells back
        parts = [p.strip() for p in line.replace("\\|", "\0").split("|")[1:-1]]
        assert [p.replace("\0", "|") for p in parts] == [c.strip() for c in cells]
