"""PRIME-RL's config names: its example configs (tests/fixtures/prime_rl/) resolve here, or say key
by key what to change; conflicts between the two spellings are errors; ``rl migrate`` prints a
config that resolves to the same thing without translation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.prime_rl.migrate import migrate
from prime_composer.prime_rl.rules import RULES, _shared_rules

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "prime_rl"
K8S = FIXTURES / "k8s-reverse-text"
SPLIT = ["--trainer", "@", str(K8S / "train.toml"), "--orchestrator", "@", str(K8S / "orch.toml"),
         "--inference", "@", str(K8S / "infer.toml")]  # fmt: skip


def resolve(*argv: str):
    config, options = resolve_rl_config(list(argv))
    return config, options.notes


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------ PRIME-RL's examples


@pytest.mark.parametrize("name", ["reverse-text", "reverse-text-2026-07", "reverse-text-2026-01"])
def test_reverse_text_in_three_generations_of_names(name: str) -> None:
    config, notes = resolve("@", str(FIXTURES / f"{name}.toml"))
    orch = config.orchestrator
    assert (config.max_steps, orch.seq_len, orch.batch_size, orch.group_size) == (20, 2048, 128, 16)
    assert orch.sampling.max_tokens == 128
    assert config.trainer.optim.lr == 3e-6
    assert config.model.name == config.inference.model.name == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert [env.id for env in orch.env] == ["reverse-text-v1" if name.endswith("07") else "reverse-text"]
    assert config.wandb is not None and (config.wandb.project, config.wandb.name) == ("reverse-text",) * 2
    assert config.wandb.mode == "auto"
    # The only key with no equivalent is the renderer, and it is said so, once.
    assert [n for n in notes if "renderer" in n] == ([] if name != "reverse-text" else [notes[0]]) and len(
        notes
    ) == (1 if name == "reverse-text" else 0)


def test_split_files_resolve_like_the_single_file() -> None:
    split, notes = resolve(*SPLIT)
    single, _ = resolve("@", str(FIXTURES / "reverse-text.toml"))
    for config in (split, single):
        assert config.orchestrator.seq_len == 2048 and config.max_steps == 20
    assert split.orchestrator.env == single.orchestrator.env
    assert split.wandb == single.wandb
    assert split.trainer.optim.lr == single.trainer.optim.lr
    assert split.orchestrator.sampling == single.orchestrator.sampling
    assert any("orchestrator.renderer.name" in n for n in notes)


def test_lora_keys_become_ours() -> None:
    config, notes = resolve("@", str(FIXTURES / "alphabet-sort.toml"))
    lora = config.trainer.model.lora
    assert lora is not None and config.trainer.model.lora_enabled
    assert (lora.rank, lora.alpha) == (32, 64.0)
    config, notes = resolve("@", str(FIXTURES / "wiki-search.toml"))
    lora = config.trainer.model.lora
    assert lora is not None and (lora.rank, lora.dropout) == (8, 0.0)
    assert lora.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert config.inference.vllm.max_lora_rank == 8  # rl passes the rank to vLLM
    assert any(
        "orchestrator.model.lora.name" in n and "served under the model's own name" in n for n in notes
    )


def test_lora_keys_without_an_equivalent_are_refused(tmp_path: Path) -> None:
    text = (FIXTURES / "alphabet-sort.toml").read_text()
    text = text.replace("[trainer.model.lora]\n", '[trainer.model.lora]\nmodules_to_save = ["lm_head"]\n')
    with pytest.raises(ConfigError, match=r"trainer\.model\.lora\.modules_to_save[\s\S]*no equivalent"):
        resolve("@", write(tmp_path, text))


def test_alphabet_sort_taskset_fields_become_args(tmp_path: Path) -> None:
    text = (FIXTURES / "alphabet-sort.toml").read_text()
    text = re.sub(r"\[trainer\.model\.lora\]\nrank = 32\nalpha = 64\n", "", text)
    config, notes = resolve("@", write(tmp_path, text))
    (env,) = config.orchestrator.env
    assert env.id == "alphabet-sort"
    assert env.args == {"min_turns": 3, "max_turns": 5, "task": {"power_per_turn": False}}
    assert {"trainer.model.impl", "trainer.model.ac.freq"} <= {
        re.search(r": (\S+) = ", n).group(1) for n in notes
    }  # type: ignore[union-attr]


def test_wiki_search_gate_gpus_and_vllm_arguments(tmp_path: Path) -> None:
    text = (FIXTURES / "wiki-search.toml").read_text()
    text = text[: text.index("[trainer.model.lora]")] + text[text.index("[orchestrator]") :]
    text = text.replace('[orchestrator.model.lora]\nname = "qwen3-4b-wiki-search"\n', "")
    config, notes = resolve("@", write(tmp_path, text))
    assert config.orchestrator.advantage.dynamic_sampling is True
    assert config.trainer.num_ranks == config.orchestrator.num_train_ranks == 2
    assert config.inference.vllm.extra_args == ["--tool-call-parser", "hermes"]
    assert config.trainer.optim.weight_decay == 0.0
    joined = "\n".join(notes)
    assert "orchestrator.concurrency.initial_inflight" in joined
    # 6 inference GPUs of one GPU each: 6 replicas on GPUs 0-5, the trainer on the next two.
    assert config.inference.num_replicas == 6
    assert config.launch.gpus == {"inference": [0, 1, 2, 3, 4, 5], "trainer": [6, 7]}
    assert "inference.backend = 'vllm'" in joined  # PRIME-RL serves with vLLM; here that is a choice


def test_wordle_player_seat_and_data_parallel() -> None:
    config, notes = resolve("@", str(FIXTURES / "wordle.toml"))
    assert [e.id for e in config.orchestrator.env] == ["wordle"]
    assert config.orchestrator.seq_len == 8192 and config.orchestrator.sampling.max_tokens == 1024
    assert config.inference.num_replicas == 6  # data_parallel_size and num_infer_gpus agree
    assert not any("data_parallel_size" in n for n in notes)


def test_hendrycks_per_process_seq_len_and_an_eval_only_taskset() -> None:
    config, notes = resolve("@", str(FIXTURES / "hendrycks-sanity.toml"))
    (env,) = config.orchestrator.env
    assert (env.id, env.name, env.eval_args) == ("math-env", "hendrycks-math", None)
    assert env.args == {"dataset_name": "mikasenghaas/Sanity-Test-R1D-1.5B", "dataset_subset": "default"}
    assert config.orchestrator.seq_len == 8192  # the orchestrator's own; the trainer's 16384 is noted
    assert config.inference.max_model_len == 8192
    assert config.orchestrator.eval.interval == 50
    assert config.trainer.num_ranks == 4
    joined = "\n".join(notes)
    assert "trainer.model.seq_len = 16384" in joined and "orchestrator.seq_len = 8192" in joined
    assert 'orchestrator.eval.source[0] = {"taskset": {"id": "aime24"}}' in joined


def test_qwen3_30b_math_multi_node(tmp_path: Path) -> None:
    urls = write(
        tmp_path,
        # plain HTTP to the inference nodes, as PRIME-RL does in a cluster: said to be private
        "[orchestrator]\ninference_private_network = true\n"
        '[orchestrator.client]\nbase_url = ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"]\n',
    )
    config, notes = resolve("@", str(FIXTURES / "qwen3-30b-math.toml"), "@", urls)
    # 2 trainer nodes of 8 GPUs (PRIME-RL's default gpus_per_node), 2 inference nodes elsewhere.
    assert (config.launch.nodes, config.trainer.num_ranks, config.orchestrator.num_train_ranks) == (2, 16, 16)
    assert config.launch.remote_inference
    assert config.orchestrator.base_url == ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"]
    orch = config.orchestrator
    assert (orch.seq_len, orch.batch_size, orch.max_off_policy_steps) == (32768, 512, 8)
    assert orch.sampling.max_tokens == 32768 and config.ckpt.interval == 100
    assert config.trainer.optim.lr == 1e-6 and config.inference.vllm.tensor_parallel_size == 8
    noted = {re.search(r": (\S+) = ", n).group(1) for n in notes}  # type: ignore[union-attr]
    assert {"log.level", "weight_broadcast.type", "slurm.job_name", "trainer.model.ep",
            "orchestrator.concurrency.initial_inflight", "orchestrator.eval.source[0]"} <= noted  # fmt: skip
    assert "trainer.optim.type" not in noted  # adamw: the optimizer here, nothing to say


# --------------------------------------------------------------------------------- mapping details


def test_multi_node_deployment_maps_to_nodes_ranks_and_remote_inference(tmp_path: Path) -> None:
    text = (
        '[deployment]\ntype = "multi_node"\nnum_train_nodes = 3\nnum_infer_nodes = 1\ngpus_per_node = 4\n'
        "nodes_per_fsdp_group = 1\n"
        "[orchestrator]\ninference_private_network = true\n"
        '[orchestrator.client]\nbase_url = ["http://infer-0:8000/v1"]\ntimeout = 60\n'
    )
    config, notes = resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))
    assert (config.launch.nodes, config.trainer.num_ranks, config.launch.remote_inference) == (3, 12, True)
    assert config.orchestrator.base_url == "http://infer-0:8000/v1"  # a list of one is one server
    joined = "\n".join(notes)
    assert "orchestrator.client.timeout = 60" in joined
    # One node per FSDP island: HSDP with a copy of the model on each of the 3 nodes.
    assert config.trainer.parallel.replicate == 3 and config.trainer.mesh_shape == (3, 4)
    # Node 0 starts the orchestrator and its share of the ranks; no inference server.
    from prime_composer.config.processes import node_processes

    assert [p.name for p in node_processes(config)] == ["orchestrator", "trainer"]
    text, problems = migrate(["@", str(FIXTURES / "reverse-text.toml"), "@", str(tmp_path / "c.toml")])
    assert problems == []
    assert "deployment.num_train_nodes = 3 -> launch.nodes" in text
    assert (
        "deployment.gpus_per_node = 4 -> trainer.num_ranks (num_train_nodes x gpus_per_node = 3 x 4" in text
    )
    assert "nodes = 3" in text and "num_ranks = 12" in text and "remote_inference = true" in text
    assert "deployment.nodes_per_fsdp_group = 1 -> trainer.parallel.replicate (num_train_nodes /" in text


def test_inference_nodes_without_their_urls_is_a_line_to_edit(tmp_path: Path) -> None:
    text = '[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\nnum_infer_nodes = 2\n'
    argv = ["@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text)]
    with pytest.raises(ConfigError, match=r"launch.remote_inference = true .* set orchestrator.base_url"):
        resolve(*argv)
    _, problems = migrate(argv)
    assert len(problems) == 1 and "orchestrator.base_url" in problems[0]


def test_single_node_deployment_changes_nothing(tmp_path: Path) -> None:
    text = '[deployment]\ntype = "single_node"\nnum_train_gpus = 2\nnum_infer_gpus = 1\ngpus_per_node = 8\n'
    config, _ = resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))
    assert (config.launch.nodes, config.trainer.num_ranks, config.launch.remote_inference) == (1, 2, False)


def test_inference_gpus_become_replicas_of_tensor_parallel_size(tmp_path: Path) -> None:
    text = (
        '[deployment]\ntype = "single_node"\nnum_train_gpus = 2\nnum_infer_gpus = 4\n'
        "[inference.parallel]\ntp = 2\n"
    )
    config, _ = resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))
    assert config.inference.num_replicas == 2 and config.inference.vllm.tensor_parallel_size == 2
    assert config.launch.gpus == {"inference": [0, 1, 2, 3], "trainer": [4, 5]}
    text, problems = migrate(["@", str(FIXTURES / "reverse-text.toml"), "@", str(tmp_path / "c.toml")])
    assert problems == []
    assert (
        "deployment.num_infer_gpus = 4 -> inference.num_replicas (num_infer_gpus / tensor_parallel_size"
        in text
    )
    assert "num_replicas = 2" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[deployment]\nnum_infer_gpus = 3\n[inference.vllm]\ntensor_parallel_size = 2\n",
            r"deployment.num_infer_gpus = 3 \(PRIME-RL\) has no equivalent here: every inference replica "
            r"takes tensor_parallel_size = 2 GPUs",
        ),
        (
            "[deployment]\nnum_infer_gpus = 4\n[inference.vllm]\ndata_parallel_size = 2\n",
            r"deployment.num_infer_gpus = 4 \(PRIME-RL's name for inference.num_replicas\) conflicts "
            r"with inference.num_replicas = 2",
        ),
        (
            '[deployment]\nnum_infer_gpus = 4\n[inference]\nbackend = "vllm"\n[inference.vllm]\ndata_parallel_size = 2\n',
            r"deployment.num_infer_gpus = 4 \(PRIME-RL's name for inference.vllm.data_parallel_size\) conflicts "
            r"with inference.vllm.data_parallel_size = 2",
        ),
        (
            '[deployment]\ntype = "multi_node"\nnum_train_nodes = 3\nnodes_per_fsdp_group = 2\n',
            r"deployment.nodes_per_fsdp_group = 2 \(PRIME-RL\) has no equivalent here: each copy of the model",
        ),
        (
            '[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\nnodes_per_fsdp_group = 1\n'
            "[trainer.model]\ndp_replicate = 1\n",
            r"trainer.parallel.replicate",
        ),
    ],
)
def test_replica_and_island_counts_that_do_not_fit_are_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))


def test_dp_replicate_is_hsdp_and_data_parallel_engines_are_replicas(tmp_path: Path) -> None:
    text = "[trainer]\nnum_ranks = 4\n[trainer.model]\ndp_replicate = 2\n[inference.vllm]\ndata_parallel_size = 3\n"
    config, _ = resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))
    assert config.trainer.mesh_shape == (2, 2) and config.inference.num_replicas == 3


def test_an_unknown_deployment_type_is_refused(tmp_path: Path) -> None:
    text = '[deployment]\ntype = "ray"\n'
    with pytest.raises(ConfigError, match=r"deployment\.type = 'ray'"):
        resolve("@", str(FIXTURES / "reverse-text.toml"), "@", write(tmp_path, text))


def test_a_prime_rl_key_and_ours_for_the_same_setting_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve("@", write(tmp_path, "seq_len = 2048\n[orchestrator]\nseq_len = 1024\n"))
    message = str(e.value)
    assert "seq_len = 2048" in message and "orchestrator.seq_len = 1024" in message
    assert message.startswith(str(tmp_path / "c.toml"))
    # Saying the same thing twice is fine.
    config, _ = resolve(
        "@", write(tmp_path, "[orchestrator]\nrollouts_per_example = 4\ngroup_size = 4\nbatch_size = 8\n")
    )
    assert config.orchestrator.group_size == 4


def test_two_sources_with_different_group_sizes_conflict(tmp_path: Path) -> None:
    text = "".join(
        f'[[orchestrator.train.source]]\ngroup_size = {g}\nenv.taskset = {{ id = "t{g}" }}\n' for g in (4, 8)
    )
    with pytest.raises(
        ConfigError, match=r"source\[1\]\.group_size = 8 .* conflicts with orchestrator.group_size = 4"
    ):
        resolve("@", write(tmp_path, text))


def test_prime_rl_and_our_environment_lists_together_are_an_error(tmp_path: Path) -> None:
    text = (
        '[[orchestrator.env]]\nid = "arith"\n[[orchestrator.train.source]]\nenv.taskset = { id = "arith" }\n'
    )
    with pytest.raises(
        ConfigError, match=r"orchestrator.train.source .* and orchestrator.env .* are both set"
    ):
        resolve("@", write(tmp_path, text))


def test_a_translated_value_still_names_its_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve("@", write(tmp_path, "seq_len = 4\n"))
    assert str(e.value) == (
        f"{tmp_path / 'c.toml'} (as seq_len): orchestrator.seq_len = 4: Input should be greater than or equal to 16"
    )


def test_flags_in_prime_rl_spelling(tmp_path: Path) -> None:
    config, _ = resolve("--orchestrator.rollouts-per-example", "4", "--orchestrator.batch-size", "8",
                        "--seq-len", "128", "--trainer.optim.max-norm", "0.5", "--monitors.wandb.project", "p")  # fmt: skip
    assert config.orchestrator.group_size == 4 and config.orchestrator.seq_len == 128
    assert config.trainer.optim.max_grad_norm == 0.5
    assert config.wandb is not None and config.wandb.project == "p"


def test_eval_source_with_a_training_taskset_becomes_its_eval_args(tmp_path: Path) -> None:
    text = """
[[orchestrator.train.source]]
name = "sums"
env.taskset = { id = "arith", max_operand = 4 }
[orchestrator.eval]
interval = 7
skip_first_step = true
num_examples = 5
sampling = { temperature = 0.5 }
[[orchestrator.eval.source]]
env.taskset = { id = "arith", max_operand = 4, split = "eval" }
"""
    config, notes = resolve("@", write(tmp_path, text))
    (env,) = config.orchestrator.env
    assert (env.args, env.eval_args, env.num_eval_examples) == ({"max_operand": 4}, {"split": "eval"}, 5)
    ev = config.orchestrator.eval
    assert (ev.interval, ev.at_start, ev.temperature) == (7, False, 0.5)
    assert notes == []


def test_optimizer_scheduler_checkpoint_resume_and_run_name(tmp_path: Path) -> None:
    text = """
output_dir = "runs"
clean = true
[run]
name = "exp1"
[resume]
step = 40
[ckpt]
interval = 20
keep_last = 3
[trainer.optim]
lr = 2e-6
max_norm = 0.3
betas2 = 0.95
[trainer.scheduler]
type = "cosine"
warmup_steps = 5
min_lr = 2e-7
"""
    config, notes = resolve("@", write(tmp_path, text))
    optim = config.trainer.optim
    assert (optim.max_grad_norm, optim.betas, optim.schedule, optim.warmup_steps) == (
        0.3,
        (0.9, 0.95),
        "cosine",
        5,
    )
    assert optim.min_lr_ratio == pytest.approx(0.1)  # 2e-7 / 2e-6
    assert (config.ckpt.interval, config.ckpt.keep, config.ckpt.resume_step, config.ckpt.resume) == (
        20,
        3,
        40,
        True,
    )
    assert config.output_dir == Path("runs/exp1") and config.launch.overwrite is True
    assert notes == []


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[orchestrator.algo]\ntype = "max_rl"\n', "orchestrator.algo.type = 'max_rl'"),
        ("[orchestrator.algo.length_penalty]\nnum_turns_weight = 0.1\n", "length_penalty.num_turns_weight"),
        ('[trainer.optim]\ntype = "muon"\n', "trainer.optim.type = 'muon'"),
        ("[trainer.loss]\ndppo_mask_low = 0.1\n", "trainer.loss.dppo_mask_low"),
        ('[[orchestrator.train.source]]\nenv.taskset = { id = "x" }\nenv.agent.harness = { id = "rlm" }\n',
         "source[0].env.agent.harness.id = 'rlm'"),
        ("[orchestrator]\ntoken_batch_size = 4096\n", "orchestrator.token_batch_size"),
    ],
)  # fmt: skip
def test_what_would_change_training_is_refused(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        resolve("@", write(tmp_path, text))


def test_our_own_keys_are_never_translated(tmp_path: Path) -> None:
    """``orchestrator.sampling.max_tokens`` is both ours and PRIME-RL's older name: read as ours."""
    config, notes = resolve("@", write(tmp_path, "[orchestrator.sampling]\nmax_tokens = 9\n"))
    assert config.orchestrator.sampling.max_tokens == 9 and notes == []


def test_entries_of_our_free_form_tables_are_never_translated(tmp_path: Path) -> None:
    """``inference.vllm.env``'s variables are not vLLM arguments, ``launch.gpus``' names not keys."""
    text = '[inference.vllm]\nenv = { VLLM_CPU_KVCACHE_SPACE = "1" }\n[launch]\ngpus = { inference = [0] }\n'
    config, notes = resolve("@", write(tmp_path, text))
    assert (
        config.inference.vllm.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
        and config.inference.vllm.extra_args == []
    )
    assert config.launch.gpus == {"inference": [0]} and notes == []


# ---------------------------------------------------------------------------------------- migrate


MIGRATABLE = ["reverse-text", "reverse-text-2026-07", "reverse-text-2026-01", "wordle", "hendrycks-sanity"]
"""(qwen3-30b-math has inference nodes without their URLs: one line to edit, tested above.)"""


@pytest.mark.parametrize("name", MIGRATABLE)
def test_migrated_config_resolves_to_the_same_without_translation(tmp_path: Path, name: str) -> None:
    text, problems = migrate(["@", str(FIXTURES / f"{name}.toml")])
    assert problems == []
    out = tmp_path / "mine.toml"
    out.write_text(text)
    migrated, notes = resolve("@", str(out))
    original, _ = resolve("@", str(FIXTURES / f"{name}.toml"))
    assert notes == []  # nothing left in PRIME-RL's names
    # Each resolve picks its own free ports (config/ports.py): compare everything else.
    for config in (migrated, original):
        config.inference.port = 1
        config.orchestrator.base_url = "http://127.0.0.1:1/v1"
    assert migrated.model_dump() == original.model_dump()


def test_migrate_lists_what_to_edit_and_exits_1(tmp_path: Path) -> None:
    text = (FIXTURES / "alphabet-sort.toml").read_text()
    text = text.replace("[trainer.model.lora]\n", '[trainer.model.lora]\nmodules_to_save = ["lm_head"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "prime_composer.launch.rl", "migrate", write(tmp_path, text)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "# TO EDIT before `uv run rl` accepts it:" in done.stdout
    assert "trainer.model.lora.modules_to_save" in done.stderr
    assert "[trainer.model.lora]\nrank = 32" in done.stdout
    assert "[orchestrator.sampling]\nmax_tokens = 768" in done.stdout


def test_migrate_of_split_files() -> None:
    text, problems = migrate(SPLIT)
    assert problems == [] and "[wandb]" in text and "orchestrator.renderer.name" in text


def test_docs_list_every_rule() -> None:
    """docs/prime-rl.md has a row for every key of the table (shared sections once, unprefixed)."""
    doc = (ROOT / "docs" / "prime-rl.md").read_text()
    per_process = {r.key for p in ("trainer.", "orchestrator.") for r in _shared_rules(p)}
    keys = {r.key for r in _shared_rules("")} | {r.key for r in RULES if r.key not in per_process}
    assert sorted(keys - set(re.findall(r"^\| `([^`]+)` \|", doc, re.MULTILINE))) == []
