import json, sys, time, statistics, httpx
url = sys.argv[1]
body = {"model": sys.argv[2] if len(sys.argv) > 2 else "x", "prompt": "Write a long story about a dragon.",
        "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True, "n_predict": 200}
for run in range(3):
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    print("chunks", len(times), "ITL p50 ms", round(statistics.median(gaps) * 1e3, 2), "mean", round((times[-1] - times[1]) / (len(times) - 2) * 1e3, 2))
