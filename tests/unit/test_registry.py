"""migrt.registry without a network: references, the auth file, the image layout checks."""

from __future__ import annotations

import base64
import json
import os

import pytest

from migrt import names
from migrt.errors import CheckpointInvalid, ConfigError, InvalidName, UsageError
from migrt.registry import auth, image
from migrt.registry.reference import is_reference, parse

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text,registry,repo,tag,digest", [
    ("oci:registry.example/team/ckpt:v3", "registry.example", "team/ckpt", "v3", None),
    ("127.0.0.1:5000/a/b", "127.0.0.1:5000", "a/b", "latest", None),
    ("localhost/ckpt@" + D, "localhost", "ckpt", None, D),
    ("reg.example:443/x/y:t1@" + D, "reg.example:443", "x/y", "t1", D),
    ("busybox", "docker.io", "library/busybox", "latest", None),
    ("team/ckpt:v1", "docker.io", "team/ckpt", "v1", None),
])
def test_parse(text, registry, repo, tag, digest):
    ref = parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)


@pytest.mark.parametrize("bad", ["", "oci:", "reg.example/Team/x", "reg.example/x:", "reg.example/x@sha256:12",
                                 "reg.example/x y", "reg.example/../x", "reg.example//x"])
def test_parse_refuses(bad):
    with pytest.raises(UsageError):
        parse(bad)


def test_reference_cannot_be_a_checkpoint_name():
    assert is_reference("oci:reg.example/a:b") and not is_reference("oci-reg")
    with pytest.raises(InvalidName):
        names.validate("oci:reg.example/a")


def _auth(tmp_path, data, mode=0o600):
    p = tmp_path / "auth.json"
    p.write_text(json.dumps(data))
    os.chmod(p, mode)
    return str(p)


def test_auth_file_forms(tmp_path):
    tok = base64.b64encode(b"u1:p:w").decode()
    path = _auth(tmp_path, {"auths": {"reg.example": {"auth": tok},
                                      "https://other.example": {"username": "u2", "password": "p2"}}})
    assert auth.load(path, "reg.example") == auth.Credentials("u1", "p:w")
    assert auth.load(path, "other.example") == auth.Credentials("u2", "p2")
    assert auth.load(path, "anon.example") is None
    assert auth.load(None, "reg.example") is None


@pytest.mark.parametrize("data,mode,match", [
    ({"auths": {"r.example": {"auth": "!!"}}}, 0o600, "base64"),
    ({"auths": {"r.example": {"identitytoken": "x"}}}, 0o600, "identity token"),
    ({"credHelpers": {"r.example": "ecr-login"}}, 0o600, "credential helper"),
    ({"auths": {}}, 0o644, "chmod 600"),
])
def test_auth_file_refused(tmp_path, data, mode, match):
    with pytest.raises(ConfigError, match=match):
        auth.load(_auth(tmp_path, data, mode), "r.example")


def _layer(rel, off, size, digest=D):
    return image.descriptor(image.FILE_TYPE, digest, size, {image.A_PATH: rel, image.A_OFFSET: str(off)})


def test_plan_files_accepts_64mib_chunks():
    big = image.CHUNK * 2 + 5
    man = {"layers": [_layer("images/pages-1.img", image.CHUNK, image.CHUNK), _layer("images/pages-1.img", 0, image.CHUNK),
                      _layer("images/pages-1.img", 2 * image.CHUNK, 5), _layer("images/x.img", 0, 0)]}
    plan = image.plan_files(man, {"images/pages-1.img": {"size": big}, "images/x.img": {"size": 0}}, "t")
    assert [c[0] for c in plan["images/pages-1.img"]] == [0, image.CHUNK, 2 * image.CHUNK]


@pytest.mark.parametrize("layers,files", [
    ([_layer("images/a.img", 0, 10)], {"images/a.img": {"size": 11}}),                  # short
    ([_layer("images/a.img", 0, 10)], {"images/a.img": {"size": 10}, "images/b.img": {"size": 1}}),  # missing
    ([_layer("../etc/passwd", 0, 10)], {"../etc/passwd": {"size": 10}}),                # traversal
    ([_layer("manifest.json", 0, 10)], {"manifest.json": {"size": 10}}),                # the manifest itself
    ([_layer("images/a.img", 0, 5), _layer("images/a.img", 5, 5)], {"images/a.img": {"size": 10}}),  # not 64 MiB
    ([{"mediaType": image.FILE_TYPE, "digest": "md5:x", "size": 1}], {}),
])
def test_plan_files_refuses(layers, files):
    with pytest.raises(CheckpointInvalid):
        image.plan_files({"layers": layers}, files, "t")


def test_kind():
    assert image.kind({"config": {"mediaType": image.CONFIG_TYPE}}) == "migrt"
    assert image.kind({"annotations": {image.CRIO_NAME: "c"},
                       "layers": [{"mediaType": image.TAR_TYPES[0]}]}) == "archive"
    with pytest.raises(CheckpointInvalid, match="not a checkpoint"):
        image.kind({"config": {"mediaType": image.OCI_CONFIG_TYPE}, "layers": []})
