"""The trace-replay teacher service: frozen agentic traces -> teacher votes -> DPO pairs.

A separate process (``uv run teacher @ teacher.toml``; ``config/teacher.py``) that replays traces
step by step, asks N frozen teacher LLMs (any OpenAI-compatible endpoint) what they would do at
the steps a value-of-information gate picks, and turns their agreement or disagreement with the
trace's action into step-level DPO pairs and process rewards, within hard budgets.

    traces.py     the JSONL trace schema, line-by-line validation, the verifiers importer
    actions.py    canonical actions (what counts as the same action), parsing teacher answers
    prompts.py    what teachers and the student are shown at a step
    gate.py       the VOI gate: per-step features and score, top-B per trace by score per dollar
    budget.py     per-trace and per-run caps that hold under concurrency
    pool.py       teacher calls: response cache -> budget -> EndpointClient -> ledger
    votes.py      votes -> pair / confirmation / process reward
    reference.py  pair token ids and reference logprobs (transformers, lazy torch)
    replay.py     plan, label, reference pass
    store.py      the SQLite store (traces, plans and labels, cache, ledger, pairs)
    pairs.py      ``PairStore``: the read side for the orchestrator's pair source
    server.py     the HTTP routes
    service.py    the process; ``main.py`` its console script

What other processes use: ``PairStore(path).take(n, after_cursor)`` (or ``GET /v1/pairs``) for
pairs, ``POST /v1/traces`` to send traces, ``PairStore.process_rewards(trace_id)`` for process
rewards. Only ``pairs.py`` is meant to be imported by them; it needs the standard library only.
"""
