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
    pool.py       teacher calls: response cache -> budget (reserved in the store) -> calls.py -> ledger
    calls.py      one bounded attempt: wall clock per attempt and step, reply bytes and tokens
    votes.py      votes -> pair / confirmation / process reward
    reference.py  pair token ids and reference logprobs (transformers, lazy torch)
    replay.py     plan, label, reference pass
    store.py      the SQLite store (traces, plans and labels, cache, ledger, pairs)
    pairs.py      ``PairStore``: the read side of the pairs, generated from ``Pair``'s fields
    client.py     ``TeacherClient``: traces in, pairs and process rewards out
    server.py     the HTTP routes
    service.py    the process; ``main.py`` its console script

What other processes use: ``client.TeacherClient`` only (the orchestrator's replay channel,
``orchestrator/replay/``): ``send(traces)`` posts to ``POST /v1/traces``, ``take_pairs(n,
after_cursor)`` and ``process_reward(trace)`` read the store. ``GET /v1/pairs`` and
``GET /v1/process_rewards/{trace_id}`` serve the same reads to people and tools off this machine.
"""
