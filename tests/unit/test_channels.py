"""The built-in channels' specs agree with the config models and the trainer's terms, the config
side of the registry stays torch-free, and the progress line shows the same columns as before the
registry (the labels listed here by hand, in the order ``launch/progress.py`` had them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prime_composer.config.channels import channels
from prime_composer.config.loss import LossConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.launch.progress import columns
from prime_composer.report import panels

REPO = Path(__file__).resolve().parents[2]


def test_builtin_specs_match_the_config_sections_and_register_their_terms() -> None:
    specs = {spec.name: spec for spec in channels()}
    assert list(specs)[:3] == ["rl", "sdpo", "replay"]
    for name in ("rl", "sdpo", "replay"):
        spec = specs[name]
        assert LossConfig.model_fields[name].annotation is spec.loss_config
        if spec.orchestrator_config is not None:
            assert OrchestratorConfig.model_fields[name].annotation is spec.orchestrator_config
    from prime_composer.trainer.losses.base import LOSS_TERMS, load_term_modules

    load_term_modules()
    assert {"rl", "sdpo", "replay"} <= set(LOSS_TERMS)


def test_progress_and_report_show_what_they_showed_before() -> None:
    assert [c.label for c in columns()] == [
        "reward", "eval acc", "loss", "entropy", "sdpo", "hinted", "pairs", "spend $", "agree", "pair age",
        "held acc", "tokens/s",
    ]  # fmt: skip
    assert {p.label for p in panels()} == {
        "reward (train samples)", "loss", "entropy", "held-out accuracy", "SDPO loss", "hinted fraction",
        "replay pairs per step", "replay DPO loss", "replay DPO accuracy", "replay DPO margin",
        "replay pair age (steps)", "teacher calls cut off", "replay held-out DPO accuracy",
        "replay held-out DPO margin", "replay reference drift (per token)", "teacher gate calibration (ECE)",
    }  # fmt: skip


def test_resolving_a_config_with_every_channel_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from prime_composer.config.resolve import resolve_rl_config\n"
        "from prime_composer.config.channels import channels\n"
        "resolve_rl_config(['@', 'configs/quickstart-sdpo.toml'])\n"
        "assert len(channels()) >= 3\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
