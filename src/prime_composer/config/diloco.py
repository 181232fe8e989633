"""Config of the Streaming DiLoCo outer loop across data centers (``[diloco]``).

Each data center (DC) trains its own copy of the model with the trainer's optimizer (the *inner*
loop). Every ``sync_every`` (H) inner steps each of the ``num_fragments`` (P) fragments of the
model is synchronised once, one fragment every H/P steps (Streaming DiLoCo's staggered schedule):
the DC sends ``global - local`` (the pseudo-gradient, quantized), every DC averages the same
contributions in the same order, and takes an outer Nesterov SGD step on its copy of the global
fragment. The exchange runs in the background for ``fragment_sync_delay`` (tau) inner steps.

What a user swaps per DC is ``cluster_id``, ``peers``, ``host``/``port`` and the secret; every
other field must be the same in every DC of a run (the payload header carries the settings that
matter, and a DC rejects payloads made with other ones).

No torch import (config rule).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.netaddr import is_loopback

Quantization = Literal["none", "int8", "int4"]
DilocoBackend = Literal["shardcast", "torchft"]
"""The outer-loop backends, each registered under its literal in ``diloco/base.py``."""
DilocoStoreName = Literal["shardcast"]
"""The stores the ``shardcast`` backend exchanges payloads through, each registered under its
literal in ``diloco/base.py`` (``STORES``)."""

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class OuterOptimConfig(BaseConfig):
    """The outer optimizer: SGD with (Nesterov) momentum on the averaged pseudo-gradient."""

    lr: float = Field(default=0.7, gt=0)
    """Outer learning rate (DiLoCo: 0.7). 1.0 without momentum is plain parameter averaging."""

    momentum: float = Field(default=0.9, ge=0, lt=1)
    """Outer momentum (DiLoCo: 0.9); 0 is plain SGD on the pseudo-gradient."""

    nesterov: bool = True
    """Nesterov momentum (``d = g + momentum * buf``) instead of heavy-ball (``d = buf``)."""


_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


def parse_relay(value: str) -> tuple[str, str | None]:
    """``(url, fingerprint)`` of a ``diloco.relay`` value: ``host:port@sha256:<64 hex>`` (HTTPS,
    certificate pinned) or ``http://host:port`` (plain; loopback or a private network only);
    ``ValueError`` saying which form is expected otherwise."""
    text = value.strip()
    if text.startswith("http://"):
        parts = urlsplit(text)
        if not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise ValueError(f"diloco.relay = {value!r}: expected http://host:port")
        return f"http://{parts.netloc}", None
    address, sep, pin = text.removeprefix("https://").partition("@")
    parts = urlsplit(f"https://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not sep or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(
            f"diloco.relay = {value!r}: expected 'host:port@sha256:<fingerprint>' (the relay's "
            "certificate, printed by `python -m prime_composer.wire.tls`) or 'http://host:port' "
            "on loopback or a private network"
        )
    try:
        fingerprint = normalize_fingerprint(pin)
    except ValueError as e:
        raise ValueError(f"diloco.relay = {value!r}: {e}") from None
    return f"https://{parts.netloc}", fingerprint


def normalize_fingerprint(value: str) -> str:
    """``sha256:<64 lowercase hex>`` from that form, bare hex, or openssl's ``AB:CD:...``;
    ``ValueError`` otherwise."""
    raw = value.strip().lower().removeprefix("sha256:").removeprefix("sha256 fingerprint=").replace(":", "")
    if not _FINGERPRINT.match(raw):
        raise ValueError(
            f"{value!r} is not a SHA-256 certificate fingerprint: expected 'sha256:' and 64 hex digits "
            "(printed by `python -m prime_composer.wire.tls --out DIR`)"
        )
    return f"sha256:{raw}"


class PeerConfig(BaseConfig):
    """Another DC of the run, as this DC reaches it."""

    cluster_id: str
    """The peer's ``diloco.cluster_id`` (payloads name their sender; the id must match)."""

    urls: list[str] = Field(default_factory=list)
    """Where to download the peer's payloads: its origin (``https://host:port``, or ``http://`` on
    loopback or a private network) first, then any shardcast relays that mirror it. The shardcast
    client spreads downloads over them by measured speed and success rate. Empty: the peer has no
    inbound port (behind NAT) and its payloads come from ``diloco.relay``."""

    # --- transport security (wire/tls.py) ---
    fingerprint: str | None = None
    """SHA-256 fingerprint of the certificate the peer's origin serves (``sha256:<64 hex>``,
    printed by ``python -m prime_composer.wire.tls --out DIR`` on the peer). Required for
    ``https://`` URLs: any other certificate is refused, whoever signed it."""

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, value: str | None) -> str | None:
        return None if value is None else normalize_fingerprint(value)


class TorchftConfig(BaseConfig):
    """``backend = "torchft"``: DiLoCo over torchft's Manager (gloo/NCCL between the DCs)."""

    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (``torchft_lighthouse --bind ... --min_replicas N``),
    exported as ``TORCHFT_LIGHTHOUSE`` for the Manager."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Time limit of a collective and of a quorum; a DC gone for longer is dropped by torchft."""

    store_port: int = Field(default=29600, ge=1, le=65535)
    """Port of this DC's own TCP store (the Manager's rendezvous inside the replica group)."""


# --- contribution validation and aggregation -------------------------------------------------


class ValidationConfig(BaseConfig):
    """What a peer's pseudo-gradient must satisfy before it is averaged, and how the round's
    contributions are combined (``[diloco.validation]``; the same in every DC: grad payloads carry
    these settings and a DC rejects payloads made with other ones). See ``diloco/aggregate.py``."""

    token_weighting: bool = False
    """Weight each contribution by the tokens it trained on (capped, see ``token_weight_cap``)
    instead of uniformly (torchft and the DiLoCo paper average uniformly). Either way a member
    that trained on no token has weight 0."""

    token_weight_cap: float = Field(default=2.0, ge=1, le=1000)
    """With ``token_weighting``: a member's weight is at most this multiple of the median token
    count of the round's members (so one DC cannot dominate the average by claiming tokens)."""

    max_num_tokens: int = Field(default=10**12, ge=1, le=2**53)
    """Largest ``num_tokens`` a payload may claim for one round; a payload claiming more (or a
    negative or non-integer count) is rejected."""

    norm_clip_ratio: float | None = Field(default=10.0, ge=1, le=1e6)
    """A member whose pseudo-gradient's L2 norm exceeds this multiple of the median norm of the
    round's other members is scaled down to that norm (None: no clipping)."""

    aggregation: Literal["mean", "trimmed_mean"] = "mean"
    """``mean``: the weighted average. ``trimmed_mean``: per coordinate, drop the
    ``trim_fraction`` largest and smallest values of the members and average the rest uniformly
    (robust to a minority of hostile DCs; needs at least 3 DCs to trim anything)."""

    trim_fraction: float = Field(default=0.25, ge=0, lt=0.5)
    """With ``trimmed_mean``: the fraction of members trimmed at each end,
    ``floor(trim_fraction * members)`` values per coordinate."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.aggregation == "trimmed_mean" and self.token_weighting:
            raise ValueError(
                'diloco.validation.aggregation = "trimmed_mean" averages uniformly: set '
                'diloco.validation.token_weighting = false or use aggregation = "mean"'
            )
        return self


class DilocoConfig(BaseConfig):
    """The Streaming DiLoCo outer loop (off by default)."""

    enabled: bool = False
    """Run the outer loop after the trainer's optimizer steps."""

    backend: DilocoBackend = "shardcast"
    """``shardcast``: each DC serves its signed payloads over HTTP and downloads its peers' (works
    across the internet, through relays, with deadlines and agreed membership). ``torchft``:
    ``torchft.local_sgd.DiLoCo`` with a lighthouse, for DCs that reach each other directly
    (gloo/NCCL); no quantization there."""

    store: DilocoStoreName | None = None
    """Where the ``shardcast`` backend publishes this DC's payloads and fetches its peers':
    ``shardcast``, an HTTP(S) origin this DC serves (``host``/``port``) plus its peers' origins and
    the relays (``diloco/shardcast_store.py``). None: ``shardcast``. Only with ``backend =
    "shardcast"``; ``torchft`` exchanges through its own process group (setting it there is an
    error)."""

    run_id: str = "prime-composer"
    """Name of the training run, carried in every payload: a DC rejects payloads of another run."""

    cluster_id: str = "dc-0"
    """This DC's name (letters, digits, ``.``, ``_``, ``-``). Contributions are averaged in the
    sorted order of cluster ids, so every DC computes bit-identical global weights."""

    peers: list[PeerConfig] = Field(default_factory=list)
    """The other DCs of the run. Empty: a single DC (the outer loop still runs, which is how the
    single-DC baseline of DiLoCo is obtained)."""

    host: str = "127.0.0.1"
    """Address this DC's shardcast origin binds. Anything but loopback requires ``secret_env``."""

    port: int = Field(default=7701, ge=1, le=65535)
    """TCP port of this DC's shardcast origin (peers list it in their ``peers[].urls``)."""

    data_dir: Path | None = None
    """Directory the origin serves and downloads land in; None is ``<output_dir>/diloco``."""

    sync_every: int = Field(default=50, ge=1)
    """H: inner steps between two synchronisations of the same fragment."""

    num_fragments: int = Field(default=1, ge=1)
    """P: fragments the model is split into (consecutive parameters of about equal size); one
    fragment is synchronised every H/P inner steps. 1 is plain DiLoCo."""

    fragment_sync_delay: int = Field(default=0, ge=0)
    """tau: inner steps the exchange of a fragment overlaps with before its result is applied
    (0 = wait for the exchange right away). Must be below H/P."""

    fragment_update_alpha: float = Field(default=0.0, ge=0, le=1)
    """How the new global fragment is merged into the local one after the outer step:
    ``local = alpha * local + (1 - alpha) * global``. 0 takes the global fragment (the local
    progress of the tau overlapping steps is dropped); 0.5 is Streaming DiLoCo's mix."""

    outer: OuterOptimConfig = OuterOptimConfig()
    """The outer optimizer."""

    quantization: Quantization = "int8"
    """How pseudo-gradients travel: ``none`` (float32), ``int8`` or ``int4`` (blockwise absmax:
    each block of ``block_size`` values is scaled by its largest magnitude and rounded to 127 or
    7 levels a side). Every DC averages the *dequantized* contributions, its own included."""

    block_size: int = Field(default=128, ge=2)
    """Values per quantization block (one float32 scale each, 3% of an int4 payload at 128). Even,
    for int4 packing."""

    error_feedback: bool = False
    """Add the quantization error of the previous round to this round's pseudo-gradient (per
    fragment, kept locally and in checkpoints), so rounding errors do not accumulate."""

    compression: Literal["none", "zlib"] = "zlib"
    """Lossless compression of the quantized payload body. Quantized codes are far from uniform
    (most are near 0), so zlib saves ~10% on int4 and more on int8 at little CPU cost."""

    round_deadline_s: float = Field(default=60.0, gt=0)
    """How long after a fragment's sync starts its peers' payloads are waited for. A DC whose
    payload is not in by then is left out of that round (and applies the others' result)."""

    dead_after_rounds: int = Field(default=3, ge=1)
    """A peer that sent no payload in this many rounds in a row is no longer waited for: the
    coordinator commits once the others are in instead of waiting ``round_deadline_s`` every round
    for it (a DC behind the relay that is down still has a relay that answers for it). Its payload
    is still taken when it is in before the others', and once it has posted again (this round or,
    late, the previous one) it is waited for again (``diloco/num_dead_peers``)."""

    min_clusters: int = Field(default=1, ge=1)
    """Fewest DCs (this one included) whose contributions make an outer step; a round with fewer
    leaves the global fragment as it was. A commit naming fewer (but not none) is rejected
    (``too_few_members``), so with 2 or more a coordinator cannot commit a round whose only member
    is itself. Set it alike on every DC."""

    secret_env: str | None = None
    """Name of the environment variable holding the run's shared secret. Every payload is
    HMAC-SHA256 signed with it and unsigned or badly signed payloads are rejected; the origin
    requires requests signed with a key derived from it (the secret itself never crosses the wire)
    on every path but ``/health``. Required with peers."""

    keep_rounds: int = Field(default=8, ge=2)
    """Rounds of payloads each origin keeps, so a restarted DC can replay the rounds since the
    newest global state it downloaded."""

    poll_interval_s: float = Field(default=0.1, gt=0)
    """How often a waiting DC asks its peers again for a payload that is not there yet."""

    torchft: TorchftConfig = TorchftConfig()
    """Settings of the ``torchft`` backend."""

    validation: ValidationConfig = ValidationConfig()
    """How peers' contributions are validated and aggregated (``ValidationConfig``)."""

    # --- Each DC's own data ------------------------------------------------------------------
    data_seed: int | None = Field(default=None, ge=0, lt=2**63)
    """Seed of this DC's data (the orchestrator's task draws and sampling; ``rl`` sets
    ``orchestrator.seed`` to it). None derives it from the run's ``seed`` and ``cluster_id``
    (``data_seed_for``), so the DCs of a run draw different data with nothing set per DC; set it
    to choose this DC's seed yourself. Model initialisation keeps the run's ``seed`` in every DC."""

    def data_seed_for(self, seed: int) -> int:
        """This DC's data seed: ``data_seed`` if set, else ``seed`` plus the first 8 bytes of
        SHA-256(``cluster_id``) as an unsigned integer, modulo 2**63."""
        if self.data_seed is not None:
            return self.data_seed
        offset = int.from_bytes(hashlib.sha256(self.cluster_id.encode()).digest()[:8], "big")
        return (seed + offset) % 2**63

    # --- transport security (wire/auth.py, wire/tls.py, diloco/shardcast_store.py) ---
    tls_cert: Path | None = None
    """PEM certificate this DC's origin serves HTTPS with (with ``tls_key``); generate both with
    ``python -m prime_composer.wire.tls --out DIR`` and give peers the fingerprint it prints."""

    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""

    private_network: bool = False
    """The links between the DCs are already private (a VPN, a private interconnect): plain
    ``http://`` between DCs and the ``torchft`` backend off loopback are allowed. Without it, a
    config whose origin binds a non-loopback address without ``tls_cert``, lists a non-loopback
    ``http://`` peer URL, or runs ``torchft`` off loopback is refused. Requests are signed either way."""

    relay: str | list[str] | None = None
    """A relay every DC of the run reaches (``rl relay @ relay.toml`` with ``kind = "diloco"``), for
    DCs with no inbound port: ``"host:port@sha256:<fingerprint>"`` (HTTPS, its certificate
    pinned) or ``"http://host:port"`` (loopback or ``private_network`` only). Set, this DC
    publishes every payload to it too (sealed: the relay can neither read, forge nor alter one),
    and fetches from it the payloads of each peer listed without ``urls``. A list of relays:
    failover; every payload goes to all of them, and listings and fetches ask the one that
    answered last first, then the others in order (list them in the same order on every DC)."""

    auth_window_s: float = Field(default=120.0, gt=0, le=3600)
    """Replay window of signed requests: one whose timestamp is further than this from the
    receiver's clock is refused, and nonces are remembered for twice as long. Keep DC clocks in
    sync (NTP) to well within it."""

    @property
    def relays(self) -> list[str]:
        """``relay`` as a list (empty without one)."""
        if self.relay is None:
            return []
        return [self.relay] if isinstance(self.relay, str) else list(self.relay)

    @property
    def store_name(self) -> DilocoStoreName:
        """The store the ``shardcast`` backend uses: ``store``, or ``shardcast`` when unset."""
        return self.store or "shardcast"

    @property
    def steps_per_fragment(self) -> int:
        """H/P: inner steps between two consecutive fragment syncs."""
        return self.sync_every // self.num_fragments

    @property
    def cluster_ids(self) -> list[str]:
        """Every DC of the run in the order contributions are averaged (sorted)."""
        return sorted([self.cluster_id, *(p.cluster_id for p in self.peers)])

    @model_validator(mode="after")
    def _check(self) -> Self:
        h, p, tau = self.sync_every, self.num_fragments, self.fragment_sync_delay
        if h % p != 0:
            raise ValueError(
                f"diloco.sync_every = {h} is not divisible by diloco.num_fragments = {p}: one "
                f"fragment syncs every sync_every / num_fragments steps; pick e.g. sync_every = "
                f"{max(p, h - h % p)}"
            )
        if tau >= h // p:
            raise ValueError(
                f"diloco.fragment_sync_delay = {tau} must be below sync_every / num_fragments = "
                f"{h // p}: a fragment's exchange must finish before the next fragment's starts"
            )
        for cid in self.cluster_ids:
            if not _ID.match(cid):
                raise ValueError(
                    f"diloco cluster id {cid!r}: use 1-64 letters, digits, '.', '_' or '-' (starting "
                    "with a letter or digit)"
                )
        if len(set(self.cluster_ids)) != len(self.cluster_ids):
            raise ValueError(
                f"diloco.cluster_id and diloco.peers[].cluster_id must all differ, got {self.cluster_ids}"
            )
        if self.min_clusters > len(self.cluster_ids):
            raise ValueError(
                f"diloco.min_clusters = {self.min_clusters} but the run has {len(self.cluster_ids)} "
                "DC(s) (cluster_id + peers): lower it or list more peers"
            )
        if self.keep_rounds <= self.num_fragments:
            raise ValueError(
                f"diloco.keep_rounds = {self.keep_rounds} must exceed diloco.num_fragments = "
                f"{self.num_fragments}: a restarted DC downloads the newest state of every fragment"
            )
        if self.block_size % 2:
            raise ValueError(f"diloco.block_size = {self.block_size} must be even (int4 packs two per byte)")
        if self.peers and self.secret_env is None:
            raise ValueError(
                "diloco.peers is set but diloco.secret_env is not: payloads cross machines and must be "
                "signed; set diloco.secret_env to the name of an environment variable holding a shared "
                "secret (the same value in every DC)"
            )
        if not is_loopback(self.host) and self.secret_env is None:
            raise ValueError(
                f"diloco.host = {self.host!r} is reachable from other machines: set diloco.secret_env "
                "to the name of an environment variable holding the run's shared secret"
            )
        if self.backend == "torchft":
            if self.store is not None:
                raise ValueError(
                    f'diloco.store = "{self.store}" is a store of backend = "shardcast"; backend = '
                    '"torchft" exchanges through torchft\'s process group: drop diloco.store or use '
                    'backend = "shardcast"'
                )
            if self.quantization != "none":
                raise ValueError(
                    f'diloco.quantization = "{self.quantization}" is not available with backend = '
                    '"torchft" (torchft\'s own quantization is FP8 through Triton and silently falls '
                    'back to full precision without it): set diloco.quantization = "none" or use '
                    'backend = "shardcast"'
                )
            if self.error_feedback:
                raise ValueError('diloco.error_feedback needs quantization, which backend = "torchft" lacks')
        return self

    @model_validator(mode="after")
    def _check_transport(self) -> Self:
        # Runs after _check (pydantic keeps the order of definition): transport rules last.
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "diloco.tls_cert and diloco.tls_key go together: set both (from `python -m "
                "prime_composer.wire.tls --out DIR`) or neither"
            )
        if self.relay is not None and not self.relays:
            raise ValueError("diloco.relay = []: list at least one relay, or leave it out")
        for relay in self.relays:
            url, _ = parse_relay(relay)
            host = urlsplit(url).hostname or ""
            if url.startswith("http://") and not is_loopback(host) and not self.private_network:
                raise ValueError(
                    f"diloco.relay = {relay!r} is plain HTTP to another machine: use "
                    "'host:port@sha256:<fingerprint>' (the relay serves --tls-cert), or set "
                    "diloco.private_network = true if the link is already private (VPN)"
                )
            if self.secret_env is None:
                raise ValueError(
                    "diloco.relay is set but diloco.secret_env is not: requests and payloads are signed"
                )
        for i, peer in enumerate(self.peers):
            where = f"diloco.peers[{i}] ({peer.cluster_id})"
            if not peer.urls and self.relay is None:
                raise ValueError(
                    f"{where}.urls is empty: list the peer's origin (https://host:port), or set "
                    'diloco.relay = "host:port@sha256:<fingerprint>" if the peer has no inbound port'
                )
            for url in peer.urls:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"{where}.urls: {url!r} is not an http:// or https:// URL with a host")
                if parts.scheme == "https" and peer.fingerprint is None:
                    raise ValueError(
                        f"{where}.urls: {url!r} is https but {where}.fingerprint is not set: pin the "
                        "peer's certificate (`python -m prime_composer.wire.tls` prints it)"
                    )
                if parts.scheme == "http" and not is_loopback(parts.hostname) and not self.private_network:
                    raise ValueError(
                        f"{where}.urls: {url!r} is plain HTTP to another machine: use https:// with "
                        f"{where}.fingerprint (the peer serves diloco.tls_cert), or set "
                        "diloco.private_network = true if the link is already private (VPN)"
                    )
        plain = self.tls_cert is None and not self.private_network
        if self.backend == "shardcast" and not is_loopback(self.host) and plain:
            raise ValueError(
                f"diloco.host = {self.host!r} serves other machines over plain HTTP: set "
                "diloco.tls_cert / diloco.tls_key (`python -m prime_composer.wire.tls --out DIR`), "
                "or diloco.private_network = true if the link is already private (VPN)"
            )
        if self.backend == "torchft" and not self.private_network:
            lighthouse = urlsplit(self.torchft.lighthouse).hostname or ""
            if not is_loopback(self.host) or not is_loopback(lighthouse):
                raise ValueError(
                    f'diloco.backend = "torchft" with diloco.host = {self.host!r} and '
                    f"diloco.torchft.lighthouse = {self.torchft.lighthouse!r}: torchft's servers and "
                    "process group have no authentication or encryption, so across machines they need a "
                    "private network; set diloco.private_network = true if the link is one (VPN, private "
                    'interconnect), or use backend = "shardcast"'
                )
        return self
