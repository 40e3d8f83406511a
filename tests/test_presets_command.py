"""`gppo presets` prints every preset's texts as they are: rich's markup does not eat brackets."""

import pytest

import gppo
from gppo.cli import main


def table_cells(text: str) -> list[list[str]]:
    """The body rows of rich's table as cell texts, each wrapped cell joined back with spaces. A row
    starts on the line whose first cell (the preset name, never wrapped) is not empty."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0]:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
    return rows


def squeeze(text: str) -> str:
    return "".join(text.split())  # rich wraps on spaces and folds long words


def test_every_summary_and_source_is_printed_verbatim(capsys):
    assert main(["presets"]) == 0
    rows = {row[0]: row for row in table_cells(capsys.readouterr().out)}
    assert set(rows) == set(gppo.PRESETS)
    bracketed = [name for name, p in gppo.PRESETS.items() if "[" in p.summary]
    assert bracketed, "no summary has brackets: the test would not see markup eat them"
    for name, p in gppo.PRESETS.items():
        *_, summary, source = rows[name]
        assert squeeze(summary) == squeeze(p.summary), name
        assert squeeze(source) == squeeze(p.source), name


@pytest.mark.parametrize("text", ["[bold]x[/bold]", "sg[min(r, 5)]", "[/]", "a \\[b]"])
def test_markup_like_texts_survive(text, capsys, monkeypatch):
    from gppo.core.presets import Preset

    preset = gppo.PRESETS["ppo"]
    monkeypatch.setattr(gppo, "PRESETS", {**gppo.PRESETS, "ppo": Preset(preset.name, text, text, preset.fields)})
    assert main(["presets"]) == 0
    rows = {row[0]: row for row in table_cells(capsys.readouterr().out)}
    assert rows["ppo"][-2:] == [text, text]
