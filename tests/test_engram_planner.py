"""The planner's engram term (`planner.engram_bytes_per_rank`, PLANNER.md §C/§F) against numbers worked out here
from the release constants (MODEL.md §A, §B.12): primes → per-rank slabs, 264 bytes a row (256 e4m3 codes + 8
ue8m0 scale bytes), and the placement ``--engram-tables auto`` picks."""

from __future__ import annotations

import json

import pytest

from dsv41_jax import engram, plan
from dsv41_jax.config import load_named
from dsv41_jax.planner import (
    GiB,
    MemoryBudget,
    PlanOptions,
    PlanRefused,
    check_memory,
    engram_bytes_per_rank,
    engram_placement,
)

ROW = 256 + 256 // 32
FLASH = load_named("dsv41_flash")


def slab_rows(cfg, world: int) -> list[int]:
    """Per layer, the largest per-rank sum of 24/W consecutive primes (independent of `column_splits`)."""
    primes = engram.layer_primes(cfg)
    return [int(p.reshape(world, -1).sum(axis=1).max()) for p in primes]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_device_tables_are_the_padded_slabs(world):
    need = engram_bytes_per_rank(FLASH, world, tables="device", dense="fp8")
    assert need["tables"] == sum(slab_rows(FLASH, world)) * ROW
    assert need["columns"] == 24 // world and need["host_tables"] == 0
    # the split costs at most a few hundred rows of padding a layer over the even share of 202.8 GB
    assert 0 <= need["tables"] - sum(FLASH.engram_num_embeddings) * ROW / world < 2 * 3000 * ROW
    assert need["gathered"] == 2048 * 24 * ROW  # one layer's all-gathered rows
    # fp8 wkv + its ue8m0 block scales (one per 32×32) + f32 q/k weights, 2 layers
    assert need["projection"] == 2 * (25600 * 6144 + 800 * 192 + 2 * 4 * 5120 * 4)


def test_whole_tables_are_the_release_bytes_and_host_keeps_only_the_gathered_rows():
    device1 = engram_bytes_per_rank(FLASH, 1, tables="device")
    assert device1["tables"] == (384006168 + 384016682) * ROW == pytest.approx(202.8e9, rel=1e-3)
    host = engram_bytes_per_rank(FLASH, 4, tables="host", rows=2048)
    assert host["tables"] == 0 and host["host_tables"] == device1["tables"]
    assert host["gathered"] == 2048 * 2 * 24 * ROW == 25_952_256  # both layers' rows sent with the call
    assert engram_bytes_per_rank(FLASH, 4, tables="host", rows=1)["gathered"] == 2 * 24 * ROW


def test_auto_placement_and_r10():
    """fp4 experts, fp8 dense (the release as stored): the split tables (47.2 GiB a rank) fit an H200 at world 4
    and 8, not at 1 or 2 (where even host placement leaves world 2 over budget on the experts alone)."""
    options = PlanOptions(experts="fp4", dense="fp8")
    assert [engram_placement(FLASH, w, options) for w in (1, 2, 4, 8)] == ["host", "host", "device", "device"]
    check_memory(FLASH, 4, PlanOptions(experts="fp4", dense="fp8", engram_tables="device"), MemoryBudget())
    with pytest.raises(PlanRefused, match=r"engram \(device tables\)"):
        check_memory(FLASH, 4, PlanOptions(experts="fp4", dense="fp8", engram_tables="device"),
                     MemoryBudget.gib(100))
    assert engram_placement(load_named("tiny_engram"), 4) == "device"


def test_plan_cli_shows_the_engram_term(capsys):
    assert plan.main(["--config", "dsv41_flash", "--world", "4", "--expert-format", "fp4", "--rows", "2048",
                      "--position", "0", "--json"]) == 0
    term = json.loads(capsys.readouterr().out)["engram"]
    assert term["placement"] == "device" and term["columns"] == 6
    assert term["device_total"] == term["tables"] + term["gathered"] + term["projection"]
    assert term["tables"] / GiB == pytest.approx(47.21, abs=0.01)
    assert plan.main(["--config", "dsv41_flash", "--world", "4", "--expert-format", "fp4", "--rows", "2048",
                      "--position", "0", "--engram-tables", "host", "--json"]) == 0
    term = json.loads(capsys.readouterr().out)["engram"]
    assert term["placement"] == "host" and term["tables"] == 0 and term["gathered"] == 25_952_256
    assert plan.main(["--config", "dsv41_flash", "--world", "4", "--expert-format", "fp4", "--rows", "2048",
                      "--position", "0"]) == 0
    out = capsys.readouterr().out
    assert "engram tables (chosen by the" in out and "split by hash column (6 of 24" in out
