"""Write the trained model as a complete Hugging Face directory (weights, config, tokenizer).

At the end of a run the trainer writes ``<output_dir>/final/`` with a model card
(``model_card.py``); ``rl export @ config.toml --checkpoint <dir>`` does the same on demand from a
trainer checkpoint (DCP shards: loaded into the base model's architecture, then saved), a published
weights directory (copied, with the base model's tokenizer) or a model directory.

The result loads with ``from_pretrained`` and as ``model.name`` everywhere (trainer, both inference
backends, the teacher), unlike ``transport/weights.py``'s published steps, which carry no
tokenizer and are meant for live weight updates. Written into a hidden temporary directory and
renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from torch import nn

from prime_composer.config.base import ModelConfig
from prime_composer.integrity import IntegrityError, write_manifest
from prime_composer.trainer.model import World, full_state_dict

logger = logging.getLogger(__name__)


def save_hf_directory(model: Any, tokenizer: Any, path: Path, world: World) -> Path:
    """Save ``model`` (sharded or not) and ``tokenizer`` to ``path``, replacing what is there.

    ``model`` is a transformers ``PreTrainedModel``. Collective under FSDP (every rank gathers
    its shards); only rank 0 writes.
    """
    path = Path(path)
    state_dict = full_state_dict(model)
    if world.is_main:
        _write_pretrained(model, state_dict, tokenizer, path)
        logger.info("saved the model and tokenizer to %s", path)
    world.barrier()
    return path


def _write_pretrained(model: Any, state_dict: dict, tokenizer: Any, path: Path) -> None:
    """``save_pretrained`` of ``model`` with ``state_dict`` and the tokenizer, atomically (one process)."""
    _retie(model, state_dict)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)

    _write_directory(path, write)


def save_lora_directory(model: Any, tokenizer: Any, path: Path, world: World, merged: bool) -> Path:
    """Save a LoRA policy (a ``peft.PeftModel``, sharded or not) to ``path``: with ``merged`` as a
    plain Hugging Face model whose adapted weights are ``W0 + scale * B @ A`` (loads with
    ``AutoModelForCausalLM.from_pretrained``), otherwise as peft's adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors``; ``PeftModel.from_pretrained`` on the
    base). The tokenizer goes with either. Collective under FSDP; only rank 0 writes."""
    from safetensors.torch import save_file

    from prime_composer.trainer.lora import adapter_config, adapter_state_dict
    from prime_composer.transport.adapter import PEFT_PREFIX, Adapter, merged_weights
    from prime_composer.transport.weights import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

    adapter = Adapter(adapter_state_dict(model), adapter_config(model))
    state = full_state_dict(model) if merged else {}
    if world.is_main:
        if merged:
            from transformers import AutoModelForCausalLM

            # peft's keys back to the base model's: drop the wrapper prefix and ``.base_layer``.
            base = {
                key.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): tensor
                for key, tensor in state.items()
                if ".lora_" not in key
            }
            base.update(merged_weights(base, adapter))
            plain = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(base.values())).dtype)
            plain.load_state_dict(base, strict=True)
            _write_pretrained(plain, plain.state_dict(), tokenizer, path)
        else:

            def write(tmp: Path) -> None:
                save_file(adapter.state_dict, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
                (tmp / ADAPTER_CONFIG_NAME).write_text(
                    json.dumps(adapter.config, indent=2, sort_keys=True) + "\n"
                )
                tokenizer.save_pretrained(tmp)

            _write_directory(path, write)
        logger.info("saved the LoRA policy (%s) to %s", "merged" if merged else "adapter", path)
    world.barrier()
    return path


def _write_directory(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a hidden temporary directory, then fsync, manifest, rename to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        write(tmp)
        for entry in tmp.iterdir():
            if entry.is_file():
                entry.chmod(0o644)  # readable by a server running as another user
                with open(entry, "rb") as f:
                    os.fsync(f.fileno())
        tmp.chmod(0o755)  # mkdtemp makes it private
        # The next stage (RL after the warm-up) checks the files against it when it loads them.
        write_manifest(tmp).chmod(0o644)
        if path.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{path.name}-", dir=path.parent))
            os.replace(path, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _retie(model: nn.Module, state_dict: dict) -> None:
    """Make tied parameters share one tensor again in ``state_dict``.

    A gathered (or copied) state dict holds separate copies of, e.g., the input embedding and a
    tied output head; ``save_pretrained`` recognises ties by shared storage, so without this it
    would write the head twice.
    """
    names_by_param: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param[id(param)].append(name)
    for names in names_by_param.values():
        present = [n for n in names if n in state_dict]
        for alias in present[1:]:
            state_dict[alias] = state_dict[present[0]]


# ------------------------------------------------------------------------- the run's exported model

FINAL_DIR = "final"
"""``<output_dir>/final/``: the model at the end of the run, as a Hugging Face directory."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def export_final(
    model: Any,
    tokenizer: Any,
    output_dir: Path,
    world: World,
    lora: Literal["merged", "adapter"] | None = None,
) -> Path:
    """Write ``<output_dir>/final/`` (weights, config, tokenizer and chat template) and its model
    card. Collective under FSDP, like ``save_hf_directory``.

    ``lora`` (a LoRA run's ``trainer.model.lora.export``): ``merged`` writes the plain model with
    the adapter folded in, ``adapter`` the peft adapter directory with the tokenizer."""
    from prime_composer.trainer.model_card import write_model_card

    path = Path(output_dir) / FINAL_DIR
    if lora is None:
        save_hf_directory(model, tokenizer, path, world)
    else:
        save_lora_directory(model, tokenizer, path, world, merged=lora == "merged")
    if world.is_main:
        write_model_card(path, output_dir)
    world.barrier()
    return path


def checkpoint_kind(path: Path) -> str:
    """``hf`` (a model directory with its tokenizer), ``weights`` (a published ``broadcasts/step_N``),
    ``adapter`` (a LoRA adapter: a published step of a LoRA run or its exported adapter) or ``dcp``
    (a trainer checkpoint: ``checkpoints/step_N`` or its ``trainer/`` part)."""
    from prime_composer.transport.adapter import is_adapter

    path = Path(path)
    if is_adapter(path):
        return "adapter"
    if (path / "config.json").is_file() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return "hf"
    if (path / "config.json").is_file() and (path / "STABLE").is_file():
        return "weights"
    if _dcp_dir(path) is not None:
        return "dcp"
    raise ValueError(
        f"{path} is not a checkpoint: expected a trainer checkpoint (checkpoints/step_N, holding "
        "trainer/model_optim), a published weights directory (broadcasts/step_N, holding config.json "
        "and STABLE), a LoRA adapter (adapter_config.json) or a Hugging Face model directory "
        "(config.json and a tokenizer)"
    )


def to_hf_directory(checkpoint: Path, base: ModelConfig, out: Path) -> Path:
    """A Hugging Face directory for ``checkpoint``: the directory itself when it is one already,
    else ``out`` written from it (the tokenizer and chat template come from ``base``, the model the
    run trained, which also gives the architecture a trainer checkpoint is loaded into). A LoRA
    adapter or a LoRA run's checkpoint is merged into ``base``'s weights."""
    kind = checkpoint_kind(checkpoint)
    if kind == "hf":  # served or copied as it is: its files are checked first
        _verify_model_directory(Path(checkpoint))
    if kind in ("hf", "weights"):
        check_model_config(Path(checkpoint), base)
    if kind == "hf":
        return Path(checkpoint)
    from prime_composer.model.resolve import resolve_model_name

    tokenizer = _load_tokenizer(base)
    if kind == "weights":
        from prime_composer.transport.weights import verify_published

        names = verify_published(checkpoint)  # weights and index, checked against their digests
        out.mkdir(parents=True, exist_ok=True)
        for name in [*names, "config.json"]:
            shutil.copyfile(Path(checkpoint) / name, out / name)
        tokenizer.save_pretrained(out)
        write_manifest(out)
        return out
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    from prime_composer.integrity import verify_manifest
    from prime_composer.trainer.checkpoint import trained_model_state

    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    def load_base(dtype: Any) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            resolve_model_name(base.name),
            dtype=dtype,
            revision=base.revision,
            trust_remote_code=base.trust_remote_code,
        )

    if kind == "adapter":
        from prime_composer.transport.adapter import load_adapter, merged_weights

        model = load_base("auto")
        weights = model.state_dict()
        model.load_state_dict({**weights, **merged_weights(weights, load_adapter(checkpoint))})
        return save_hf_directory(model, tokenizer, out, world)
    part = _dcp_dir(checkpoint)
    assert part is not None  # checkpoint_kind said dcp
    verify_manifest(part)
    model = load_base(_dcp_dtype(part / "model_optim"))
    lora = json.loads((part / "meta.json").read_text()).get("extra", {}).get("lora")
    if lora is not None:  # a LoRA run's checkpoint holds the adapter only: rebuild it on the base
        from prime_composer.config.trainer import LoraConfig
        from prime_composer.trainer.lora import apply_lora, base_fingerprint, check_base, lora_record

        cfg = LoraConfig(rank=lora["rank"], alpha=lora["alpha"], target_modules=tuple(lora["target_modules"]))
        check_base(lora, lora_record(base.name, base_fingerprint(model), cfg), f"the checkpoint {checkpoint}")
        model = apply_lora(model, cfg)
    from prime_composer.trainer.checkpoint import check_architecture

    check_architecture(part, model, base.name)  # a smaller base would drop trained layers silently
    state = {"model": trained_model_state(model)}  # what a checkpoint holds
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(part / "model_optim"), no_dist=True)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    if lora is not None:
        model = model.merge_and_unload()
    return save_hf_directory(model, tokenizer, out, world)


ARCHITECTURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
"""The ``config.json`` fields that decide the shape of every tensor (compared before loading)."""


def check_model_config(directory: Path, base: ModelConfig) -> None:
    """Refuse a model directory (or published weights) whose architecture differs from the run's
    ``base`` model: one-line ``ValueError`` naming both and the first fields that differ."""
    from transformers import AutoConfig

    from prime_composer.model.resolve import resolve_model_name

    saved = json.loads((Path(directory) / "config.json").read_text())
    kwargs: dict[str, Any] = {"revision": base.revision, "trust_remote_code": base.trust_remote_code}
    if base.gguf_file is not None:
        kwargs["gguf_file"] = base.gguf_file
    try:
        expected = AutoConfig.from_pretrained(resolve_model_name(base.name), **kwargs).to_dict()
    except IntegrityError:
        raise  # the base model's own files are damaged: that is an error, not a skipped check
    except (OSError, ValueError) as e:  # e.g. a hub id without network: say so, do not guess
        logger.warning(
            "the architecture of %s is not checked against model.name = %r, whose config cannot be read (%s)",
            directory,
            base.name,
            e,
        )
        return
    differ = [
        f"{key} {saved[key]} in the checkpoint, {expected[key]} in the model"
        for key in ARCHITECTURE_KEYS
        if key in saved and key in expected and saved[key] != expected[key]
    ]
    if differ:
        raise ValueError(
            f"{directory} holds another model than model.name = {base.name!r}: {'; '.join(differ)}. "
            "Use the model the run trained (its configs/rl.json), or another checkpoint"
        )


def _dcp_dir(path: Path) -> Path | None:
    """The trainer part holding ``model_optim/`` for ``checkpoints/step_N`` or ``.../trainer``."""
    for candidate in (Path(path), Path(path) / "trainer"):
        if (candidate / "model_optim" / ".metadata").is_file():
            return candidate
    return None


def _dcp_dtype(directory: Path) -> Any:
    """The dtype the model's tensors were saved in (so an export keeps the trained precision)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(entry, "properties"):
            return entry.properties.dtype
    raise ValueError(f"{directory}: no model tensors in this checkpoint")


def _load_tokenizer(base: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    from prime_composer.model.resolve import resolve_model_name

    return AutoTokenizer.from_pretrained(
        resolve_model_name(base.name), revision=base.revision, trust_remote_code=base.trust_remote_code
    )


def export_checkpoint(config: Any) -> Path:
    """``rl export``: the model directory (and card) of ``config.checkpoint`` (default: the newest
    complete checkpoint of the run) in ``config.export_dir`` (default: ``<output_dir>/final``).

    Never clobbers: an existing target is refused unless ``config.force``. The input is verified
    first (its manifest), the whole result is written into a hidden sibling directory and renamed
    into place, so a failed export leaves the target as it was and no file of an earlier model
    (a stale sharded index) mixes in."""
    from prime_composer.checkpoint_layout import latest_complete_step, step_dir
    from prime_composer.trainer.model_card import write_model_card

    output_dir = Path(config.output_dir)
    checkpoint = config.checkpoint
    if checkpoint is None:
        root = output_dir / "checkpoints"
        step = latest_complete_step(root, ("trainer",))
        if step is None:
            raise ValueError(f"no complete trainer checkpoint under {root}: give --checkpoint <dir>")
        checkpoint = step_dir(root, step)
    out = Path(config.export_dir) if config.export_dir is not None else output_dir / FINAL_DIR
    kind = checkpoint_kind(checkpoint)
    if kind == "hf" and Path(checkpoint).resolve() == out.resolve():
        write_model_card(out, output_dir)  # exporting a model directory onto itself: the card only
        return out
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"export_dir = '{out}' exists and is not a directory: choose another --export-dir")
    if out.exists() and not config.force:
        raise ValueError(
            f"export_dir = '{out}' already exists: pass --force to replace it (its files are deleted), "
            "or choose another --export-dir"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model_dir = staging / "model"
        if kind == "hf":
            to_hf_directory(checkpoint, config.model, model_dir)  # checks it: architecture, files
            shutil.copytree(checkpoint, model_dir)
        else:
            path = to_hf_directory(checkpoint, config.model, model_dir)
            assert path == model_dir
        write_model_card(model_dir, output_dir)
        write_manifest(model_dir)  # of exactly what was written, card included
        model_dir.chmod(0o755)
        if out.exists():  # --force: the old directory goes only once the new one is complete
            os.replace(out, staging / "old")
        os.replace(model_dir, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _verify_model_directory(directory: Path) -> None:
    """Check a model directory before copying it: its files against its ``MANIFEST.json`` (every
    directory this project writes has one); without one, that each weights file's header reads."""
    from prime_composer.integrity import MANIFEST_NAME, verify_manifest

    if (directory / MANIFEST_NAME).is_file():
        verify_manifest(directory)
        return
    logger.warning("%s has no %s: only its weights files' headers are checked", directory, MANIFEST_NAME)
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error type for a damaged header
            raise ValueError(
                f"{path}: not a readable safetensors file ({e}); the model directory is damaged"
            ) from e


def main(argv: Any) -> int:
    """``rl export @ config.toml [--checkpoint <dir>] [--export-dir <dir>] [--force]``."""
    from prime_composer.config.cli import run_entry_point
    from prime_composer.config.errors import ConfigError
    from prime_composer.config.evaluate import ExportConfig, resolve_kwargs

    def run(config: ExportConfig) -> int:
        try:
            out = export_checkpoint(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except OSError as e:  # the target under a regular file, a read-only mount, a full disk
            target = config.export_dir or Path(config.output_dir) / FINAL_DIR
            raise ConfigError(
                f"rl export: cannot write export_dir = '{target}': {e.strerror or e}"
                + (f" ({e.filename})" if e.filename else "")
                + "; nothing was changed there. Choose another --export-dir (or free space)"
            ) from None
        print(f"rl export: wrote {out} (a Hugging Face model directory with its model card)")
        return 0

    return run_entry_point(
        ExportConfig,
        run,
        prog="rl export",
        argv=list(argv),
        describe="Write a checkpoint as a Hugging Face model directory with a model card.",
        **resolve_kwargs(ExportConfig),
    )
