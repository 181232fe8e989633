"""``ablate``: arms x seeds run one after another, resumed from their digests, failures reported.

The fast tests drive the harness with a stand-in launcher (``rl_command``) that writes metrics
files the way ``rl`` does, so resume and a failing arm-seed are cheap to prove; the slow one runs
the real ``rl`` on a 2-arm x 2-seed, 2-step preset of the quickstart whose arms share a short
warm-up per seed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.eval import ablate

REPO = Path(__file__).resolve().parents[2]

FAKE_RL = textwrap.dedent(
    '''
    """Stand-in for rl: reads the generated config, writes metrics like rl, fails on request."""
    import json, sys, tomllib
    from pathlib import Path

    path = Path(sys.argv[sys.argv.index("@") + 1])
    cfg = tomllib.loads(path.read_text())
    fake = cfg.get("fake", {})
    steps = cfg.get("max_steps", 3)
    warmup = cfg.get("warmup", {})
    resolved = {"max_steps": steps, "orchestrator": {"batch_size": 8, "group_size": 4, "env": []}}
    if "enabled" in warmup:  # the keys a shared warm-up is checked on, as rl resolves them
        resolved["warmup"] = warmup
        resolved["model"] = cfg.get("model", {"name": "tiny"})
        optim = {"lr": 1e-3, "betas": [0.9, 0.99], **cfg.get("trainer", {}).get("optim", {})}
        resolved["trainer"] = {"optim": optim}
    if "--dry-run" in sys.argv:
        print(json.dumps(resolved))
        sys.exit(0)
    out = Path(cfg["output_dir"])
    if warmup.get("only"):  # rl --warmup.only: the warm-up's model, nothing else
        with (out.parent / "calls.txt").open("a") as f:
            f.write(f"{cfg['seed']}\\n")
        if cfg["seed"] in fake.get("fail_warmup_seeds", []):
            print("the warm-up broke", file=sys.stderr)
            sys.exit(4)
        final = out / "sft" / "final"
        final.mkdir(parents=True, exist_ok=True)
        (final / "config.json").write_text("{}")
        (final / "model.safetensors").write_bytes(b"weights of seed %d" % cfg["seed"])
        sys.exit(0)
    calls = out.parent / "calls.txt"
    with calls.open("a") as f:
        f.write(f"{cfg['seed']}\\n")
    if warmup.get("enabled") is False and "model" in cfg:
        with (out.parent / "models.txt").open("a") as f:
            f.write(f"{cfg['seed']} {cfg['model']['name']}\\n")
    if cfg["seed"] in fake.get("fail_seeds", []):
        print("something broke in this run", file=sys.stderr)
        sys.exit(3)
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    gain = fake.get("gain", 0.0)
    with (out / "metrics" / "orchestrator.jsonl").open("w") as f:
        for step in range(steps + 1):
            rec = {"step": step}
            if step < steps:
                rec["reward/mean"] = 0.1 * step + 0.01 * cfg["seed"] + gain
            if step in (0, steps):
                rec["eval/accuracy"] = 0.2 + (0.05 * cfg["seed"] + gain if step else 0.0)
            f.write(json.dumps(rec) + "\\n")
    with (out / "metrics" / "trainer.jsonl").open("w") as f:
        for step in range(steps):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\\n")
    if fake.get("usd"):
        with (out / "metrics" / "teacher.jsonl").open("w") as f:
            f.write(json.dumps({"step": 0, "teacher/spent_usd": fake["usd"]}) + "\\n")
    '''
)


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "fake_rl.py").write_text(FAKE_RL)
    (tmp_path / "base.toml").write_text("max_steps = 3\n")
    path = tmp_path / "ablation.toml"
    path.write_text(
        f'rl_command = ["{sys.executable}", "{tmp_path / "fake_rl.py"}"]\n'
        f'output_dir = "{tmp_path / "out"}"\n' + textwrap.dedent(body)
    )
    return path


PRESET = """
base = ["base.toml"]
seeds = [0, 1]
[arms.grpo]
[arms.better]
set = { "fake.gain" = 0.1, "fake.usd" = 0.25 }
"""


def _calls(tmp_path: Path, arm: str) -> list[str]:
    p = tmp_path / "out" / "runs" / arm / "calls.txt"
    return p.read_text().split() if p.exists() else []


def test_runs_every_arm_seed_writes_the_table_and_resumes_from_digests(tmp_path: Path) -> None:
    config = ablate.load_config(_write(tmp_path, PRESET))
    lines: list[str] = []
    summary = ablate.run_ablation(config, echo=lines.append, poll_s=0.05)
    assert _calls(tmp_path, "grpo") == ["0", "1"] and _calls(tmp_path, "better") == ["0", "1"]
    assert any(line.startswith("ablate [4/4] better seed 1: done") for line in lines)
    better = summary["arms"]["better"]
    # Final held-out: grpo 0.20, 0.25; better 0.30, 0.35 -> paired difference exactly 0.1 each seed.
    assert better["final_eval"]["mean"] == pytest.approx(0.325)
    assert better["vs_baseline"]["final_eval"]["mean"] == pytest.approx(0.1)
    assert better["vs_baseline"]["final_eval"]["ci_low"] == pytest.approx(0.1)  # no spread in the differences
    assert better["teacher_usd"] == pytest.approx(0.5) and summary["arms"]["grpo"]["teacher_usd"] == 0.0
    # Final train reward = the last step's: 0.2 + 0.01 * seed (+ 0.1): means 0.205 and 0.305.
    assert summary["arms"]["grpo"]["final_reward"]["mean"] == pytest.approx(0.205)
    out = tmp_path / "out"
    data = json.loads((out / "ablation.json").read_text())
    assert data["summary"]["arms"]["better"]["seeds_ok"] == [0, 1]
    assert {(r["arm"], r["seed"]) for r in data["runs"]} == {
        ("grpo", 0),
        ("grpo", 1),
        ("better", 0),
        ("better", 1),
    }
    assert "| better | 2/2 |" in (out / "ablation.md").read_text()
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Rerun: nothing runs again.
    lines.clear()
    again = ablate.run_ablation(
        ablate.load_config(tmp_path / "ablation.toml"), echo=lines.append, poll_s=0.05
    )
    assert _calls(tmp_path, "grpo") == ["0", "1"] and _calls(tmp_path, "better") == ["0", "1"]
    assert sum("skipped" in line for line in lines) == 4
    assert again["arms"] == summary["arms"]

    # A damaged metrics file no longer matches its digest: that arm-seed alone runs again.
    metrics = out / "runs" / "better" / "seed1" / "metrics" / "orchestrator.jsonl"
    metrics.write_text(metrics.read_text().replace('"step": 1,', '"step": 1, "x": 0,'))
    ablate.run_ablation(ablate.load_config(tmp_path / "ablation.toml"), echo=lines.append, poll_s=0.05)
    assert _calls(tmp_path, "better") == ["0", "1", "1"] and _calls(tmp_path, "grpo") == ["0", "1"]


def test_a_failed_arm_seed_is_reported_left_out_of_the_means_and_retried(tmp_path: Path) -> None:
    path = _write(tmp_path, PRESET + '[arms.broken]\nset = { "fake.fail_seeds" = [1] }\n')
    lines: list[str] = []
    summary = ablate.run_ablation(ablate.load_config(path), echo=lines.append, poll_s=0.05)
    broken = summary["arms"]["broken"]
    assert broken["seeds_ok"] == [0] and broken["seeds_failed"] == [1]
    assert broken["final_eval"]["n"] == 1 and broken["final_eval"]["ci_low"] is None
    assert broken["vs_baseline"]["final_eval"]["n"] == 1
    assert any("broken seed 1: FAILED (exit 3)" in line for line in lines)
    out = tmp_path / "out"
    md = (out / "ablation.md").read_text()
    assert "| broken | 1/2 |" in md and "something broke in this run" in md
    run = next(
        r
        for r in json.loads((out / "ablation.json").read_text())["runs"]
        if r["arm"] == "broken" and r["seed"] == 1
    )
    assert run["status"] == "failed" and run["returncode"] == 3
    # The failed one (only) is tried again on the next invocation.
    ablate.run_ablation(ablate.load_config(path), echo=lines.append, poll_s=0.05)
    assert _calls(tmp_path, "broken") == ["0", "1", "1"]
    assert main_exit(path) == 1


def test_a_subset_of_arms_and_seeds_from_the_command_line(tmp_path: Path) -> None:
    path = _write(tmp_path, PRESET)
    assert ablate.main(["@", str(path), "--arms", "better", "--seeds", "1"]) == 0
    assert _calls(tmp_path, "better") == ["1"] and _calls(tmp_path, "grpo") == []
    data = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert [(r["arm"], r["seed"]) for r in data["runs"]] == [("better", 1)]
    with pytest.raises(ConfigError, match="--arms: 'nope' is not an arm"):
        ablate.load_config(path, {"only_arms": ["nope"]})


WARM = """
base = ["base.toml"]
seeds = [0, 1]
set = { "warmup.enabled" = true }
[arms.grpo]
[arms.better]
set = { "fake.gain" = 0.1, "trainer.optim.lr" = 3e-3 }
"""


def _warmups(tmp_path: Path) -> list[str]:
    p = tmp_path / "out" / "warmups" / "calls.txt"
    return p.read_text().split() if p.exists() else []


def test_arms_of_a_seed_start_from_one_shared_warmup_which_a_rerun_reuses(tmp_path: Path) -> None:
    path = _write(tmp_path, WARM)
    lines: list[str] = []
    summary = ablate.run_ablation(ablate.load_config(path), echo=lines.append, poll_s=0.05)
    out = tmp_path / "out"
    assert _warmups(tmp_path) == ["0", "1"]  # one warm-up per seed, not one per arm-seed
    for arm in ("grpo", "better"):  # each arm-seed started from its seed's warm-up, warm-up off
        models = (out / "runs" / arm / "models.txt").read_text().splitlines()
        assert models == [f"{seed} {out / 'warmups' / f'seed{seed}' / 'sft' / 'final'}" for seed in (0, 1)]
    assert summary["arms"]["better"]["seeds_ok"] == [0, 1]
    assert "Every arm of a seed starts from the same warm-up" in (out / "ablation.md").read_text()
    warmups = json.loads((out / "ablation.json").read_text())["warmups"]
    assert [(w["seed"], w["status"]) for w in warmups] == [(0, "ok"), (1, "ok")]

    lines.clear()
    ablate.run_ablation(ablate.load_config(path), echo=lines.append, poll_s=0.05)
    assert _warmups(tmp_path) == ["0", "1"] and _calls(tmp_path, "grpo") == ["0", "1"]
    assert sum("reused" in line for line in lines) == 2 and sum("skipped" in line for line in lines) == 4

    # Damaged warm-up weights: that warm-up runs again; the arms ran from the same bytes, so they stay.
    weights = out / "warmups" / "seed1" / "sft" / "final" / "model.safetensors"
    weights.write_bytes(b"damaged")
    ablate.run_ablation(ablate.load_config(path), echo=lines.append, poll_s=0.05)
    assert _warmups(tmp_path) == ["0", "1", "1"] and _calls(tmp_path, "better") == ["0", "1"]
    assert weights.read_bytes() == b"weights of seed 1"


def test_a_failed_shared_warmup_fails_its_seeds_arms_with_the_reason(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        WARM.replace('"warmup.enabled" = true', '"warmup.enabled" = true, "fake.fail_warmup_seeds" = [1]'),
    )
    summary = ablate.run_ablation(ablate.load_config(path), echo=lambda _: None, poll_s=0.05)
    assert summary["arms"]["grpo"]["seeds_failed"] == [1] and summary["arms"]["better"]["seeds_failed"] == [1]
    assert _calls(tmp_path, "grpo") == ["0"]  # seed 1's arms never started
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "**grpo seed 1**: its shared warm-up failed" in md and "the warm-up broke" in md


@pytest.mark.slow
def test_an_arm_that_would_warm_up_differently_cannot_share_the_warmup(tmp_path: Path) -> None:
    body = WARM + '[arms.other-betas]\nset = { "trainer.optim.betas" = [0.8, 0.9] }\n'
    with pytest.raises(
        ConfigError, match=r"arms.other-betas: trainer.optim = .* differs from the shared warm-up's"
    ):
        ablate.run_ablation(ablate.load_config(_write(tmp_path, body)), echo=lambda _: None)
    assert _warmups(tmp_path) == []  # refused before anything ran
    # Without sharing each arm-seed warms up on its own, and the arm is accepted.
    config = ablate.load_config(_write(tmp_path, "share_warmup = false\n" + body))
    ablate.run_ablation(config, echo=lambda _: None, poll_s=0.05)
    assert _warmups(tmp_path) == [] and _calls(tmp_path, "other-betas") == ["0", "1"]


def main_exit(path: Path) -> int:
    return ablate.main(["@", str(path)])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('base = ["base.toml"]\nseed = [0]\n[arms.a]\n', "seed: unknown key"),
        ("[arms.a]\n", "base: missing"),
        ('base = ["nope.toml"]\n[arms.a]\n', "base: 'nope.toml' does not exist"),
        ('base = ["base.toml"]\nseeds = [0, 0]\n[arms.a]\n', "seeds: [0, 0] must be"),
        ('base = ["base.toml"]\n', "arms: missing or empty"),
        ('base = ["base.toml"]\n[arms.a]\nconfig = ["x"]\n', "arms.a.config: unknown key"),
        ('base = ["base.toml"]\nbaseline = "b"\n[arms.a]\n', "baseline: 'b' is not one of the arms"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(
        ConfigError, match=f"ablation.toml: {message}".replace("[", r"\[").replace("(", r"\(")
    ):
        ablate.load_config(_write(tmp_path, body))


def test_arms_that_do_not_train_on_the_same_samples_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, PRESET + "[arms.longer]\nset = { max_steps = 5 }\n")
    with pytest.raises(ConfigError, match=r"arms.longer: max_steps = 5 differs from arm grpo's 3"):
        ablate.run_ablation(ablate.load_config(path), echo=lambda _: None)
    assert not (tmp_path / "out" / "runs" / "grpo" / "calls.txt").exists()  # nothing ran


SMALL = """
# The quickstart's model and task, 2 arms x 2 seeds of 2 steps each, from a 5-step warm-up per seed
# that both arms of the seed share; one eval at the start and one at the end.
base = ["{quickstart}"]
seeds = [0, 1]
output_dir = "{out}"
set = {{ max_steps = 2, "orchestrator.batch_size" = 16, "orchestrator.group_size" = 4, "orchestrator.eval.interval" = 2, "warmup.max_steps" = 5, "warmup.num_examples" = 64, "ckpt.interval" = 0 }}
[arms.grpo]
[arms.lr-high]
set = {{ "trainer.optim.lr" = 3e-3 }}
"""


@pytest.mark.slow
def test_real_rl_two_arms_two_seeds_from_shared_warmups_then_resume(tmp_path: Path) -> None:
    path = tmp_path / "ablation.toml"
    out = tmp_path / "out"
    path.write_text(SMALL.format(quickstart=REPO / "configs" / "quickstart.toml", out=out))
    proc = subprocess.run(
        [sys.executable, "-m", "prime_composer.eval.ablate", "@", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "ablation.json").read_text())
    assert len(data["runs"]) == 4 and all(r["status"] == "ok" for r in data["runs"])
    assert [(w["seed"], w["status"]) for w in data["warmups"]] == [(0, "ok"), (1, "ok")]
    for r in data["runs"]:
        assert sorted(map(int, r["reward_curve"])) == [0, 1]
        assert 0.0 <= r["final_reward"] <= 1.0 and 0.0 <= r["final_eval"] <= 1.0
        # The run's numbers are its metrics file's.
        orch = [json.loads(line) for line in (Path(r["run_dir"]) / "metrics" / "orchestrator.jsonl").open()]
        assert r["final_reward"] == [x for x in orch if "reward/mean" in x][-1]["reward/mean"]
        # It trained from its seed's shared warm-up: no warm-up of its own.
        resolved = json.loads((Path(r["run_dir"]) / "configs" / "rl.json").read_text())
        assert resolved["model"]["name"] == str(out / "warmups" / f"seed{r['seed']}" / "sft" / "final")
        assert not (Path(r["run_dir"]) / "sft").exists()
    for seed in (0, 1):  # both arms of a seed start from the same weights: the same greedy eval at step 0
        starts = {r["initial_eval"] for r in data["runs"] if r["seed"] == seed}
        assert len(starts) == 1, (seed, starts)
    lr_high = data["summary"]["arms"]["lr-high"]
    grpo_eval = {r["seed"]: r["final_eval"] for r in data["runs"] if r["arm"] == "grpo"}
    arm_eval = {r["seed"]: r["final_eval"] for r in data["runs"] if r["arm"] == "lr-high"}
    assert lr_high["vs_baseline"]["final_eval"]["mean"] == pytest.approx(
        ((arm_eval[0] - grpo_eval[0]) + (arm_eval[1] - grpo_eval[1])) / 2
    )
    assert "ablate [4/4] lr-high seed 1: done" in proc.stdout
    assert proc.stdout.count("warm-up seed") >= 2 and "| lr-high | 2/2 |" in (out / "ablation.md").read_text()
    assert (out / "ablation.png").stat().st_size > 1000
    again = subprocess.run(
        [sys.executable, "-m", "prime_composer.eval.ablate", "@", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("skipped") == 4 and again.stdout.count("reused") == 2
    assert not math.isnan(
        json.loads((out / "ablation.json").read_text())["summary"]["arms"]["grpo"]["final_reward"]["mean"]
    )
