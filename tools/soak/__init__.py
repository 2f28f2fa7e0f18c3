"""Fault and soak driver: mixed, partly hostile traffic against a live prefixgate server while
its prefixes file is edited, then an audit of what the server was left with.

    .venv/bin/python -m tools.soak --duration 180 --out soak.json       # embedded SmolLM2
    .venv/bin/python -m tools.soak --model /path/to/hf-folder --block-size 4 \\
        --num-kv-blocks 128 --max-model-len 256 --duration 120
    .venv/bin/python -m tools.soak --url http://127.0.0.1:8000 --prefixes-file prefixes.yaml

Why: unit and route tests each check one fault at a time on a quiet server. What breaks in
production is the combination: a client that vanishes mid-stream while the KV pool is full
and a preempted request is being recomputed while the registry swaps prefixes. This tool
makes those overlap for minutes and then checks invariants that must hold however the
interleaving went:

- no response is a 5xx (client side, and in the server's own `prefixgate_requests_total`),
  and no stream carries a `server_error` event;
- every error is OpenAI-shaped: exactly `{"error": {"message", "type", "param", "code"}}`;
- every stream the client did not cut ends with `data: [DONE]`; no request hangs;
- every hostile body gets exactly its own status;
- once idle, no KV block is leaked: `kv_blocks_total - kv_blocks_free - kv_blocks_pinned == 0`;
- after every edit of the prefixes file settles, GET /v1/prefixes lists exactly the names of
  the last valid file written, and never the subset a half-written file holds.

By default it starts its own server (`python -m prefixgate serve` on 127.0.0.1, a free port,
a small KV pool so that long requests force preemptions, a prefixes file of its own in the
work directory) and stops it by PID at the end: SIGTERM, a bounded wait, then SIGKILL. With
`--url` it drives a server that is already running, on 127.0.0.1 or localhost only; edits then
need `--prefixes-file` (the file that server watches), whose content is restored at the end.

Traffic (each request drawn from `random.Random(f"{seed}:{index}")`, so a seed replays the
same mix whatever the timing): streaming and non-streaming chat and completions, some with a
registered prefix, `--long-rate` of them long (max_tokens near max_model_len, `ignore_eos`)
to exhaust the pool; `--disconnect-rate` of them are cut by the client (a stream after a
random number of events, a non-streaming request by an early client timeout); `--hostile-rate`
are hostile bodies (invalid JSON, lone surrogates as raw JSON escapes, special-token text in
user content, wrong types, deep nesting, wrong content type or key...), each with the one
status it must get. Edits (every `--edit-interval` s) are valid (atomic replace), invalid
(must be refused, the old registry kept serving) or truncated: the new file written in place
in two halves cut at an entry boundary with `--truncated-pause` s between them. The server
reloads a file only once two polls (`--prefix-watch-interval`, 1 s) read the same content, so
a pause shorter than one poll interval never looks stable to it, and it must never act on
the half. If it does, the check sees it in the listing (the half's names) or in the hit
counts of the entries the half file drops (an entry dropped and re-created restarts from
zero hits).

The JSON report (--out): schema, command, git_revision, date, cpu_capability (torch), torch,
settings, server (url, pid, log, exit code), results (every count), failures. The exit
status is 0 when `failures` is empty, 1 when not, 2 when the soak could not run.

Modules, each importing only those before it: `config` (settings, target), `exchange` (a
planned request and its outcome), `results` (the tallies and the verdict), `server` (the
process, /metrics, the registry listing), `checks` (OpenAI shapes, registry state, leaked
blocks), `client` (sending one exchange), `hostile`, `prefixes` (the file's contents),
`traffic` (the mix and its workers), `edits` (writing the file and settling), `runner` (one
whole soak), `report`, `cli`.
"""
