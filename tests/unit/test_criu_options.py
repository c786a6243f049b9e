"""CriuOptions: one flat value, recorded in the manifest at dump and reused at restore."""

from __future__ import annotations

import dataclasses

import pytest

from migrt.config import CRIU_OPTION_KEYS
from migrt.criu.options import CriuOptions
from migrt.runtime.argv import COMMAND_BOOL_FLAGS


def test_defaults_are_all_off():
    opts = CriuOptions()
    assert opts.runc_flags() == []
    assert opts.to_dict() == {"tcp_established": False, "ext_unix_sk": False, "shell_job": False, "file_locks": False}


def test_runc_flags_in_field_order():
    opts = CriuOptions(tcp_established=True, ext_unix_sk=True, shell_job=True, file_locks=True)
    assert opts.runc_flags() == ["--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks"]
    assert CriuOptions(file_locks=True).runc_flags() == ["--file-locks"]


def test_every_flag_is_a_bool_flag_of_both_runc_checkpoint_and_restore():
    everything = CriuOptions(**{f.name: True for f in dataclasses.fields(CriuOptions)})
    for flag in everything.runc_flags():
        name = flag.removeprefix("--")
        assert name in COMMAND_BOOL_FLAGS["checkpoint"], flag
        assert name in COMMAND_BOOL_FLAGS["restore"], flag


def test_config_keys_match_the_fields():
    assert set(CRIU_OPTION_KEYS) == {f.name for f in dataclasses.fields(CriuOptions)}


def test_dict_round_trip():
    opts = CriuOptions(tcp_established=True, file_locks=True)
    assert CriuOptions.from_dict(opts.to_dict()) == opts


@pytest.mark.parametrize(("data", "expected"), [
    (None, CriuOptions()),
    ({}, CriuOptions()),
    ({"tcp_established": 1, "shell_job": "yes"}, CriuOptions(tcp_established=True, shell_job=True)),
    ({"ext_unix_sk": 0, "leave_running": True, "future_option": True}, CriuOptions()),  # unknown keys ignored
])
def test_from_dict(data, expected):
    assert CriuOptions.from_dict(data) == expected


def test_merged_only_switches_options_on():
    base = CriuOptions(tcp_established=True)
    merged = base.merged(file_locks=True, tcp_established=False)
    assert merged == CriuOptions(tcp_established=True, file_locks=True)
    assert base == CriuOptions(tcp_established=True)  # frozen: merged returns a new value


def test_merged_refuses_unknown_options():
    with pytest.raises(TypeError):
        CriuOptions().merged(lazy_pages=True)


def test_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CriuOptions().tcp_established = True  # type: ignore[misc]
