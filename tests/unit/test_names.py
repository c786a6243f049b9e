"""Checkpoint names: what validate accepts and refuses; sanitize always yields a valid name."""

from __future__ import annotations

import random
import string

import pytest

from migrt import names
from migrt.errors import InvalidName, UsageError


@pytest.mark.parametrize("name", [
    "a", "0", "train-7", "job.v2", "a_b", "x-1.2_3", "a" * 128, "a" + "-" * 126 + "b", "9lives",
    "a.b.c", "a-.-b",
])
def test_accepts(name):
    assert names.validate(name) == name


@pytest.mark.parametrize("name", [
    "", "a" * 129, "..", ".", "a..b", "../etc", "a/b", "/abs", "/", "./a", "Train", "ABC", "a b", "-a", "a-",
    ".a", "a.", "_a", "a_", "a\n", "\na", "a\x00b", "a:b", "a\\b", "é", "a*", "~a", "a\tb",
])
def test_refuses(name):
    with pytest.raises(InvalidName):
        names.validate(name)


def test_invalid_name_is_a_usage_error_with_exit_code_2():
    with pytest.raises(UsageError) as info:
        names.validate("a/b")
    assert info.value.exit_code == 2
    assert "'a/b'" in str(info.value)
    assert "no paths" in str(info.value)


def test_length_message_names_the_limit():
    with pytest.raises(InvalidName, match="129 characters long; at most 128"):
        names.validate("a" * 129)


def test_empty_and_non_string():
    with pytest.raises(InvalidName, match="empty"):
        names.validate("")
    with pytest.raises(InvalidName):
        names.validate(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [
    ("abc123", "abc123"),
    ("My_Container", "my_container"),
    ("a/b/c", "a-b-c"),
    ("../../etc/passwd", "etc-passwd"),
    ("a..b", "a.b"),
    ("...", "ckpt"),
    ("", "ckpt"),
    ("///", "ckpt"),
    ("--x--", "x"),
    ("k8s_POD_name_ns_uid_0", "k8s_pod_name_ns_uid_0"),
    ("a" * 300, "a" * 100),
])
def test_sanitize(text, expected):
    assert names.sanitize(text) == expected


def test_sanitize_truncation_does_not_end_on_a_separator():
    out = names.sanitize("a" * 99 + "-" + "b" * 50)
    assert out == "a" * 99
    assert names.validate(out) == out


def test_sanitize_output_is_always_valid():
    rng = random.Random(1234)
    alphabet = string.ascii_letters + string.digits + "._-/ \n\t:é\\" + "."
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 160)))
        out = names.sanitize(text)
        assert names.validate(out) == out, (text, out)
        assert len(out) <= 100
