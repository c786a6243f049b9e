"""bench/registry.py's pure pieces: how a restore got its pages (from its log records), the medians
of several runs, and issue 30's targets met or missed."""

from bench.registry import medians, restore_path, targets


def _restored(mode: str, **pages) -> dict:
    return {"event": "restored", "container_id": "c", "pages": {"mode": mode, **pages}}


def test_restore_path_full_pull_lazy_and_store():
    full = [{"event": "restore_image_ready", "pulled": True, "lazy": False}, _restored("lazy")]
    assert restore_path(full) == "full pull, then lazy"
    fallback = [{"event": "registry_lazy_fallback", "reason": "GPU"}, {"event": "restore_image_ready", "pulled": True},
                _restored("eager")]
    assert restore_path(fallback) == "full pull (lazy fallback), then eager"
    lazy = [{"event": "restore_image_ready", "pulled": False, "lazy": True}, _restored("lazy", source="registry")]
    assert restore_path(lazy) == "lazy from registry"
    assert restore_path([_restored("lazy")]) == "store, lazy"
    assert restore_path([{"event": "restore_image_ready", "pulled": False}, _restored("eager")]) == "store, eager"


def test_medians_of_numbers_and_words():
    runs = [{"a_s": 1.0, "path": "full pull, then lazy", "paths": ["x"], "ok": True},
            {"a_s": 3.0, "path": "lazy from registry", "paths": ["y", "x"], "ok": True},
            {"a_s": 2.0, "path": "full pull, then lazy", "paths": ["x"], "ok": True}]
    out = medians(runs)
    assert out["a_s"] == 2.0
    assert out["path"] == "full pull, then lazy / lazy from registry"
    assert out["paths"] == "x / y"
    assert "ok" not in out  # booleans are not figures


def test_targets_met_missed_and_unmeasured():
    row = {"byref_running_ratio": 2.5, "byref_fill_vs_get_pump": 0.85, "wire_push_vs_put_pump": 0.8,
           "wire_pull_vs_get_pump": 0.79}
    got = {t["target"].split(" ")[0] + t["bound"]: t["met"] for t in targets(row)}
    assert got == {"by<= 2": False, "by>= 0.8": True, "push>= 0.8": True, "pull>= 0.8": False, "4<= 3": None}
