"""`python -m dsv41_jax.plan`: JSON fields, the readable table, refusals on stderr with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_jax.config import load_named
from dsv41_jax.param_specs import model_tensors
from dsv41_jax.plan import main
from dsv41_jax.planner import PLANNED_ONLY, param_bytes_per_rank


def _json(capsys, *args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_fields_world4_rank2(capsys):
    out = _json(capsys, "--config", "dsv41_flash", "--world", "4", "--rank", "2", "--rows", "2048",
                "--position", "300000", "--experts", "fp4")
    for key in ("head_tile", "output_groups", "moe_blocks", "moe_block_rows", "workspace_bytes", "cache_bytes",
                "total_bytes"):
        assert key in out
    # PLANNER.md B-1/B-2: BMQ 16 at W = 4, 2 groups a rank, one x3gm block of 12,288 pairs, z = 4·12,288·5,120.
    assert (out["head_tile"], out["output_groups"], out["moe_blocks"], out["moe_block_rows"]) == (16, 2, 1, 12288)
    assert out["workspace_bytes"]["L.moe.z"] == 251_658_240
    assert out["total_bytes"] == out["weight_bytes"] + out["cache_bytes"] + sum(out["workspace_bytes"].values())
    assert out["admission"]["expert_widths"] == [640, 640, 512, 512]
    assert out["admission"]["expert_columns_padded"] == [1280, 1792]


def test_speculate_counts_the_dspark_stages(capsys):
    """``--speculate``: the weights include the three DSpark stages (§B.13), split like backbone layers; their bytes
    are those of the stages' tensors in the inventory (``param_specs.model_tensors(dspark=True)``)."""

    args = ("--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "0")
    plain, spec = _json(capsys, *args), _json(capsys, *args, "--speculate")
    cfg = load_named("dsv41_flash")
    stages = param_bytes_per_rank(cfg, 4, 0, experts="fp4", dense="fp8", dspark=True) - plain["weight_bytes"]
    assert spec["weight_bytes"] - plain["weight_bytes"] == stages
    # 3 stages of 128 experts (fp4) + attention: a few GB at world 4, a sliver of the 77 GiB a rank holds
    assert 1 << 30 < stages < 4 << 30
    assert any(n.startswith("mtp.2.") for n in model_tensors(cfg, dspark=True))


def test_json_tiny_world8_replay_4k(capsys):
    out = _json(capsys, "--config", "tiny", "--world", "8", "--rows", "1024", "--position", "0", "--replay",
                "--pf4k", "--images")
    assert out["head_tile"] == 2 and out["output_groups"] == 1  # 16 heads / 8, 8 groups / 8
    assert out["ring_rows"] == 8192 and out["image_rows"] == -1 and out["replay"]["decoder_start"] == 6


def test_table_output(capsys):
    assert main(["--config", "tiny", "--world", "4", "--rows", "17", "--position", "5"]) == 0
    text = capsys.readouterr().out
    assert "head tile" in text and "L.moe.z" in text


def test_row_parallel_is_the_plans_choice(capsys):
    """``--row-parallel-rows N``: a segment of at least N rows (a multiple of the world) runs its per-row work
    row-parallel; fewer rows, one device, or the default (0) do not. The kernel tiles carry the threshold."""
    assert main(["--config", "tiny", "--world", "4", "--rows", "16", "--position", "0",
                 "--row-parallel-rows", "16"]) == 0
    assert "this segment" in capsys.readouterr().out
    assert main(["--config", "tiny", "--world", "4", "--rows", "12", "--position", "0",
                 "--row-parallel-rows", "16"]) == 0
    assert "off (--row-parallel-rows 16)" in capsys.readouterr().out
    tiles = _json(capsys, "--config", "tiny", "--world", "1", "--rows", "16", "--position", "0",
                  "--row-parallel-rows", "16")["kernel_tiles"]
    assert tiles["row_parallel_rows"] == 0  # one device: nothing to split over
    with pytest.raises(SystemExit) as e:
        main(["--config", "tiny", "--world", "2", "--rows", "16", "--position", "0", "--row-parallel-rows", "-1"])
    assert e.value.code == 2


def _run(*args):
    return subprocess.run([sys.executable, "-m", "dsv41_jax.plan", *args], capture_output=True, text=True)


def test_refusal_exits_2_with_reason():
    r = _run("--config", "dsv41_flash", "--world", "2", "--rows", "4096", "--position", "0")
    assert r.returncode == 2 and "R1" in r.stderr and "4K mode" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_memory_refusal_and_bad_config(capsys):
    assert main(["--config", "dsv41_flash", "--world", "4", "--rows", "16", "--position", "0", "--experts", "fp8",
                 "--dense", "fp8", "--budget-gib", "139"]) == 2
    err = capsys.readouterr().err
    assert "R10" in err and "rank 0" in err and "fp4 experts" in err
    assert main(["--config", "/nonexistent/config.json", "--world", "1", "--rows", "1", "--position", "0"]) == 2
    assert "no config file" in capsys.readouterr().err


_FLASH_W4 = ("--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "300000")


def test_default_memory_check_is_the_h200(capsys):
    # PLANNER.md §F: 139 GiB usable a device; bf16 experts at world 4 need ~295 GiB, fp4 ones fit (~83 GiB)
    bf16 = ("--experts", "bf16", "--dense", "bf16")
    assert main([*_FLASH_W4, *bf16]) == 2
    err = capsys.readouterr().err
    assert "R10" in err and "139.0 GiB usable" in err and "Use fp4 experts" in err
    assert main([*_FLASH_W4, "--experts", "fp4"]) == 0
    assert main([*_FLASH_W4, *bf16, "--no-memory-check"]) == 0
    assert main([*_FLASH_W4, *bf16, "--budget-gib", "400"]) == 0  # the explicit budget overrides the default
    capsys.readouterr()
    assert main([*_FLASH_W4, "--experts", "fp4", "--budget-gib", "50"]) == 2
    assert "50.0 GiB usable" in capsys.readouterr().err


def test_formats_default_to_what_the_config_says_is_stored(capsys, tmp_path):
    """Issue 12 #3: dsv41_flash's quantization_config stores fp8 dense matrices and fp4 routed experts, so
    ``plan`` without --experts/--dense plans those (and fits the H200 from world 4 on); flags override."""
    r = _run("--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "0")  # the issue's
    assert r.returncode == 0 and "fp4 experts, fp8 dense" in r.stdout, r.stderr
    assert main(["--config", "dsv41_flash", "--world", "8", "--rows", "2048", "--position", "0"]) == 0
    capsys.readouterr()
    default = _json(capsys, *_FLASH_W4)
    assert default["weight_formats"] == {"experts": "fp4", "dense": "fp8"}
    assert default == _json(capsys, *_FLASH_W4, "--experts", "fp4", "--dense", "fp8")
    bf16_experts = _json(capsys, *_FLASH_W4, "--experts", "bf16", "--no-memory-check")
    assert bf16_experts["weight_formats"] == {"experts": "bf16", "dense": "fp8"}  # one flag: the other from config
    assert bf16_experts["weight_bytes"] > default["weight_bytes"]
    assert _json(capsys, "--config", "tiny", "--world", "2", "--rows", "8", "--position", "0")[
        "weight_formats"] == {"experts": "bf16", "dense": "bf16"}  # no quantization_config: plain bf16
    raw = json.loads((Path(__file__).resolve().parent.parent / "configs" / "tiny.json").read_text())
    for quant, formats in [({"quant_method": "fp8", "expert_dtype": "bf16"}, {"experts": "bf16", "dense": "fp8"}),
                           ({"quant_method": "fp8"}, {"experts": "fp8", "dense": "fp8"})]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
        assert _json(capsys, "--config", str(tmp_path), "--world", "2", "--rows", "8", "--position", "0")[
            "weight_formats"] == formats
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "int4"}}))
    assert main(["--config", str(tmp_path), "--world", "2", "--rows", "8", "--position", "0"]) == 2
    err = capsys.readouterr().err
    assert "int4" in err and "--dense" in err and len(err.strip().splitlines()) == 1


def test_help_says_where_the_format_defaults_come_from():
    r = _run("--help")
    assert r.returncode == 0 and "quantization_config" in " ".join(r.stdout.split())


@pytest.mark.parametrize("args, says", [
    (("--position", "-1"), "--position: -1 must be ≥ 0"),
    (("--rows", "0"), "--rows: 0 must be ≥ 1"),
    (("--budget-gib", "-1"), "--budget-gib: -1 must be a number > 0"),
    (("--index-budget-mib", "0"), "--index-budget-mib: 0 must be ≥ 1"),
    (("--index-budget-mib", "-5"), "--index-budget-mib: -5 must be ≥ 1"),
    (("--world", "two"), "--world: 'two' is not an integer"),
])
def test_bad_arguments_one_line_exit_2(capsys, args, says):
    base = {"--world": "4", "--rows": "16", "--position": "0"}
    base.update(dict(zip(args[::2], args[1::2])))
    with pytest.raises(SystemExit) as e:
        main(["--config", "tiny", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1 and "usage" not in err


def test_missing_argument_one_line_in_a_subprocess():
    r = _run("--config", "tiny", "--world", "4", "--rows", "16")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: the following arguments are required: --position (see --help)")


def test_planned_only_options_are_marked_in_help_and_plan(capsys):
    """Issue #13: options no engine path runs are marked as planned only in --help and in the printed plan."""

    r = _run("--help")
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    assert "planned only" in flat and "no engine path replays" in flat
    for key in PLANNED_ONLY:
        assert f"{key}:" in flat
    out = _json(capsys, "--config", "tiny", "--world", "4", "--rows", "1024", "--position", "0", "--replay",
                "--moe", "halving", "--experts", "bf16", "--dense", "bf16")
    assert {"replay", "staging_ring", "moe_blocks"} <= set(out["planned_only"])
    assert "fp8_weights" not in out["planned_only"]
    assert main(["--config", "tiny", "--world", "4", "--rows", "1024", "--position", "0", "--replay"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "planned only: replay" in text and "not run by the engine" in text


def test_memory_left_for_the_cache(capsys):
    """The release at world 4 (fp4 experts) fits an H200 rank with fp8 dense weights as stored, and the plan says what
    R10 leaves for the cache: usable − every R10 term but the KV pool; fp8 dense leaves more than bf16 by the dense
    bytes it saves (and the engram projection's, also fp8) less the fp8 op's K-split workspace, and each sequence's
    longest context fits its share."""
    from dsv41_jax.planner import PlanOptions, kv_bytes  # noqa: PLC0415

    args = ("--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "0", "--experts", "fp4",
            "--engram-tables", "host", "--slots", "8")
    fp8, bf16 = (_json(capsys, *args, "--dense", d)["memory"] for d in ("fp8", "bf16"))
    cfg = load_named("dsv41_flash")
    dense = {d: param_bytes_per_rank(cfg, 4, 0, experts="fp4", dense=d, split="dense") for d in ("fp8", "bf16")}
    assert fp8["left"] == fp8["usable"] - fp8["fixed"] > 0
    plans = {d: _json(capsys, *args, "--dense", d) for d in ("fp8", "bf16")}
    engram = {d: p["engram"]["projection"] for d, p in plans.items()}
    splits = plans["fp8"]["buffer_plan_bytes"]["L.fp8_splits"] - plans["bf16"]["buffer_plan_bytes"]["L.fp8_splits"]
    saved = dense["bf16"] - dense["fp8"] + engram["bf16"] - engram["fp8"] - splits
    assert fp8["left"] - bf16["left"] == saved > 0
    longest = fp8["max_context"]
    assert 0 < longest <= cfg.max_position_embeddings
    assert kv_bytes(cfg, longest, 4, PlanOptions(slots=8)) <= fp8["left"] // 8
    assert main([*args, "--dense", "fp8"]) == 0
    assert "R10: left for the cache" in capsys.readouterr().out
