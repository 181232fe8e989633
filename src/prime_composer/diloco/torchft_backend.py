"""``backend = "torchft"``: the same outer loop run by ``torchft.local_sgd.DiLoCo``.

For DCs that reach each other directly (gloo / NCCL between them, a torchft lighthouse
reachable by all). torchft hooks the inner optimizer: the pseudo-gradient of a fragment is
all-reduced (averaged) among the replicas of the current quorum and the outer optimizer (here
``torch.optim.SGD`` with this config's lr / momentum / Nesterov, one per fragment) steps on it;
a replica that fails or joins is handled by the lighthouse's quorum, and a restarted one heals
from a peer (model, inner optimizer, the fragments' global copies and outer momentum) over
torchft's HTTP checkpoint transport.

Departures from the shardcast backend, all because torchft does them its way:

- no quantization (torchft's ``should_quantize`` is FP8 through Triton and silently sends full
  precision without it; the config refuses int8/int4 with this backend);
- contributions are averaged uniformly, not weighted by tokens;
- fragments sync on torchft's own schedule: fragment ``i`` after ``(i + 1) * H / P`` steps of
  each cycle (the same staggering), counted in optimizer steps, so a skipped update (no
  ``optimizer.step()``) does not move it either;
- no signed payloads: the process group is as trusted as the network it runs on.

Its checkpoint part (``part.py``, the same files as the shardcast loop's) holds torchft's manager
step, the inner step within the current fragment period, the fragments' global weights and outer
momentum. A checkpoint taken inside a fragment's overlap window (``fragment_sync_delay > 0``,
after the pseudo-gradient was taken and before it is applied) takes that fragment's
pseudo-gradient again on load, from the restored local weights: every DC resuming from the same
step does the same, so they still agree, but the result differs from an uninterrupted run there.

Start the lighthouse first: ``torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas N``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prime_composer.config.diloco import DilocoConfig
from prime_composer.diloco.base import register_outer_loop
from prime_composer.diloco.fragments import Fragment, split_fragments
from prime_composer.diloco.part import read_part, write_part

logger = logging.getLogger(__name__)


class _FragmentModule(nn.Module):
    """A module that owns nothing but exposes one fragment's parameters (torchft wants modules)."""

    def __init__(self, fragment: Fragment) -> None:
        super().__init__()
        self._fragment_params = list(zip(fragment.names, fragment.params, strict=True))

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(self._fragment_params)

    def parameters(self, recurse: bool = True) -> Any:
        return iter(p for _, p in self._fragment_params)


@register_outer_loop("torchft")
class TorchftOuterLoop:
    """The ``OuterLoop`` contract over ``torchft.local_sgd.DiLoCo`` (see the module docstring);
    ``work_dir`` is not used (torchft keeps its state in memory and heals over HTTP)."""

    def __init__(
        self, cfg: DilocoConfig, model: nn.Module, inner_optimizer: torch.optim.Optimizer, work_dir: Path
    ) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.local_sgd import DiLoCo

        from prime_composer.diloco import torchft_bind

        assert cfg.backend == "torchft" and cfg.quantization == "none"
        self.cfg = cfg
        self.model = model
        self.optimizer = inner_optimizer
        timeout = timedelta(seconds=cfg.torchft.timeout_s)
        # Every server torchft starts listens on cfg.host only (torchft_bind.py), checked below.
        self._listening_before = torchft_bind.listening_sockets()
        # The replica group's own store (this DC is one replica of world size 1).
        # The TCPStore owns the socket from here on (it closes the fd when it goes; closing it here
        # too would close whatever a later socket reuses that fd number for).
        listen_fd = torchft_bind.store_socket(cfg.host, cfg.torchft.store_port).detach()
        self._store = TCPStore(
            cfg.host,
            cfg.torchft.store_port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        self.fragments = split_fragments(model, cfg.num_fragments)
        modules = [_FragmentModule(f) for f in self.fragments]
        outer = [
            torch.optim.SGD(
                list(f.params), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov
            )
            for f in self.fragments
        ]
        with torchft_bind.manager_bound_to(cfg.host):
            self.manager = Manager(
                pg=torchft_bind.gloo_bound_to(cfg.host, timeout),
                checkpoint_transport=torchft_bind.bound_transport(cfg.host, timeout),
                load_state_dict=self._load_replica_state,
                state_dict=self._replica_state,
                min_replica_size=cfg.min_clusters,
                use_async_quorum=False,
                replica_id=cfg.cluster_id,
                store_addr=cfg.host,
                store_port=cfg.torchft.store_port,
                rank=0,
                world_size=1,
                lighthouse_addr=cfg.torchft.lighthouse,
                hostname=cfg.host,
                port=cfg.port,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                # Every DC starts from the same weights (same model, same seed). With init_sync torchft
                # copies one replica's weights to the others at the first quorum, which DiLoCo only
                # holds after the first H/P inner steps: it would overwrite their local progress.
                init_sync=False,
            )
        torchft_bind.check_bound(cfg.host, self._listening_before)
        self._checked_gloo = False
        self.diloco = DiLoCo(
            self.manager,
            modules,
            inner_optimizer,
            outer,
            sync_every=cfg.sync_every,
            backup_device=torch.device("cpu"),
            pin_memory=False,
            should_quantize=False,
            fragment_sync_delay=cfg.fragment_sync_delay,
            fragment_update_alpha=cfg.fragment_update_alpha,
        )
        self.diloco.__enter__()
        self._outer = outer
        self._synced = self.manager.current_step()
        self.last_metrics: dict[str, float] = {}
        """``diloco/round`` (torchft's outer step, from 0) and ``diloco/num_members`` of the newest
        outer step this DC took part in."""
        os.environ.setdefault("TORCHFT_LIGHTHOUSE", cfg.torchft.lighthouse)

    def _replica_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    @property
    def theta(self) -> list[torch.Tensor]:
        """The fragments' global weights (torchft's CPU backups), flat float32."""
        out = []
        for fragment, torchft_fragment in zip(self.fragments, self.diloco._fragments, strict=True):
            backup = torchft_fragment.original_parameters
            out.append(torch.cat([backup[n].reshape(-1).float() for n in fragment.names]))
        return out

    def after_inner_step(self, step: int, num_tokens: int, skipped: bool) -> bool:
        """True when torchft applied an outer step during this step's ``optimizer.step()``."""
        current = self.manager.current_step()
        changed, self._synced = current != self._synced, current
        if changed and not self._checked_gloo:  # gloo's sockets exist from the first quorum on
            from prime_composer.diloco.torchft_bind import check_bound

            check_bound(self.cfg.host, self._listening_before, "torchft's gloo process group")
            self._checked_gloo = True
        if changed:
            self.last_metrics = {
                "diloco/round": float(current - 1),
                "diloco/num_members": float(self.manager.num_participants()),
            }
        return changed

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values (safetensors- and JSON-friendly) that resume this loop."""
        manager = self.manager.state_dict()
        state: dict[str, Any] = {
            "manager_step": int(manager["step"]),
            "batches_committed": int(manager["batches_committed"]),
            "local_step": int(self.diloco._local_step),
        }
        for f, theta in enumerate(self.theta):
            state[f"theta.{f}"] = theta
            for i, param_state in self._outer[f].state_dict()["state"].items():
                if param_state.get("momentum_buffer") is not None:
                    state[f"momentum.{f}.{i}"] = param_state["momentum_buffer"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (after the model's weights)."""
        self.manager.load_state_dict(
            {"step": int(state["manager_step"]), "batches_committed": int(state["batches_committed"])}
        )
        for f, (fragment, torchft_fragment) in enumerate(
            zip(self.fragments, self.diloco._fragments, strict=True)
        ):
            theta, offset = state[f"theta.{f}"], 0
            for name in fragment.names:
                backup = torchft_fragment.original_parameters[name]
                backup.copy_(theta[offset : offset + backup.numel()].view_as(backup))
                offset += backup.numel()
            outer = self._outer[f]
            saved = outer.state_dict()
            saved["state"] = {
                i: {"momentum_buffer": state[f"momentum.{f}.{i}"].clone()}
                for i in range(len(fragment.params))
                if f"momentum.{f}.{i}" in state
            }
            outer.load_state_dict(saved)
        self.diloco._local_step = int(state["local_step"])
        self._synced = self.manager.current_step()
        period, delay = self.cfg.steps_per_fragment, self.cfg.fragment_sync_delay
        if delay and period - delay <= self.diloco._local_step < period:
            # Inside the overlap window: the pseudo-gradient taken before the save is gone.
            self.manager.start_quorum()
            self.diloco._fragments[self.diloco._current_fragment()].prepare_sync()

    def save(self, root: Path, step: int) -> Path:
        """Write the ``diloco`` part of checkpoint ``step`` (``part.write_part``)."""
        return write_part(root, step, self.state_dict())

    def load(self, root: Path, step: int) -> None:
        """Restore the ``diloco`` part of checkpoint ``step``, verified against its manifest."""
        self.load_state_dict(read_part(root, step))

    def finish(self) -> None:
        """Nothing held back for the end: torchft writes each round's result into the model when
        it applies it, so ``final/`` is the model as the last inner step left it."""

    def global_digest(self) -> str:
        h = hashlib.sha256()
        for t in self.theta:
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
