"""The knob table (scheduler.config.KNOBS) is the one place a config key is declared: the TOML validation, `serve`'s
flags and docs/configuration.md are made from it, and each of them is checked here against it."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from unisched.cli.args import knob_flags
from unisched.cli.parser import build_parser
from unisched.scheduler.config import KNOBS, ConfigError, DaemonConfig, load_config
from unisched.scheduler.configdoc import REGENERATE, markdown, tuning_constants
from unisched.scheduler.knobs import Knob, shown

ROOT = Path(__file__).resolve().parent.parent


def _other_value(k: Knob) -> tuple[str, Any]:
    """A valid value that is not the default: as a flag argument and as the TOML value."""
    if k.kind == "choice":
        pick = next(c for c in reversed(k.choices) if c != shown(k.default))
        return pick, pick
    if k.kind in ("int", "float"):
        assert k.bounds is not None
        lo, hi = k.bounds
        n: Any = hi if hi != k.default else lo
        n = int(n) if k.kind == "int" else float(n)
        return str(n), n
    if k.kind == "str":
        return "host.example:7480", "host.example:7480"
    return "", not k.default


def test_every_config_field_is_a_knob_in_one_section() -> None:
    tables = {"tenants", "tidal"}  # arrays of tables, listed by TENANT_KEYS and TIDAL_KEYS
    assert {k.name for k in KNOBS} == {f.name for f in dataclasses.fields(DaemonConfig)} - tables
    assert all(k.section in ("daemon", "policy") and k.help for k in KNOBS)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_each_flag_sets_its_key(k: Knob) -> None:
    arg, value = _other_value(k)
    argv = ["serve", k.flag_name, *([arg] if arg else [])]
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    unset = build_parser().parse_args(["serve"])
    assert DaemonConfig().with_overrides(**knob_flags(unset)) == DaemonConfig()  # no flag, no change
    got = getattr(DaemonConfig().with_overrides(**knob_flags(args)), k.name)
    assert got == k.parse(value) and got != k.default, (argv, got)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_each_key_in_its_section_loads_and_a_bad_value_names_it(tmp_path: Path, k: Knob) -> None:
    _, value = _other_value(k)
    toml = tmp_path / "c.toml"
    spelled = f'"{value}"' if isinstance(value, str) else str(value).lower()
    toml.write_text(f"[{k.section}]\n{k.name} = {spelled}\n")
    assert getattr(load_config(toml), k.name) == k.parse(value)
    bad = "[1]" if k.kind in ("str", "choice", "bool") else (k.bounds[1] + 1 if k.bounds else '"x"')
    toml.write_text(f"[{k.section}]\n{k.name} = {bad}\n")
    with pytest.raises(ConfigError, match=f"config '{k.name}': must be "):
        load_config(toml)
    other = "policy" if k.section == "daemon" else "daemon"
    toml.write_text(f"[{other}]\n{k.name} = {spelled}\n")
    with pytest.raises(ConfigError, match=rf"belongs in \[{k.section}\]"):
        load_config(toml)


def test_serve_help_states_each_knobs_range_and_default() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    helps = {a.dest: a.help or "" for a in serve._actions}
    for k in KNOBS:
        text = helps[k.name].replace("%%", "%")
        if k.kind == "bool":
            assert f"{'on' if k.default else 'off'} by default" in text, (k.name, text)
            continue
        if k.default_text:
            assert f"default: {k.default_text}" in text, (k.name, text)
        else:
            assert ("unset by default" if k.default is None else f"default {k.default_shown}") in text, (k.name, text)
        if k.bounds:
            assert k.range_text in text, (k.name, text)


def test_docs_configuration_is_what_the_table_generates() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text() == markdown(), f"docs/configuration.md is stale; run: {REGENERATE}"
    for k in KNOBS:
        assert f"| `{k.name}` |" in page.read_text()


def test_the_tuning_constants_listed_exist_with_their_values() -> None:
    from unisched.policy import tuning
    from unisched.scheduler import context, leases, registration, upkeep

    modules = {m.__name__: m for m in (context, leases, registration, upkeep, tuning)}
    listed = tuning_constants()
    assert {c.name for c in listed} >= {"Tuning.saturation_enter_s", "SAVE_DELAY_S", "Tuning.turn_cpu_cores",
                                         "Tuning.run_units", "Tuning.mix_sum"}
    for c in listed:
        value = (getattr(tuning.TUNING, c.name.split(".", 1)[1]) if c.name.startswith("Tuning.")
                 else getattr(modules[c.module], c.name))
        assert ast.literal_eval(c.value) == value, c  # the source text is the value in force
