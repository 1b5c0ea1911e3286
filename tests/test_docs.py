"""The configuration reference (docs/configuration.md) describes the settings that exist, with
the defaults they have: its tables are checked against the one definition of each."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cartridges.selfstudy.config import TrainConfig
from cartridges.server.settings import ENV_VARS, Settings

CONFIGURATION = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


def table_rows(section: str) -> dict[str, list[str]]:
    """The rows of the tables under heading `section` (up to the next heading of its level),
    by the first cell's `name`."""
    level = re.match(r"#+", section).group(0)
    start = CONFIGURATION.index(section + "\n")
    end = CONFIGURATION.find("\n" + level + " ", start + len(section))
    rows = {}
    for line in CONFIGURATION[start:end if end != -1 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and cells:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_every_training_field_is_documented_with_its_default():
    rows = table_rows("### Fields")
    assert set(rows) == set(TrainConfig.model_fields)
    for name, info in TrainConfig.model_fields.items():
        documented = rows[name][0].split()[0].strip("`")
        assert documented in (json.dumps(info.default), str(info.default)), (name, documented)


def test_every_server_setting_is_documented_with_its_variable_and_default():
    rows = table_rows("## The server (`cartridges serve`)")
    assert set(rows) == set(Settings.model_fields)
    for name, (flag, variable, default, _) in rows.items():
        assert variable.strip("`") == ENV_VARS.get(name, "none"), name
        value = Settings.model_fields[name].default
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            assert default.split()[0].strip("`") == str(value), name
