"""Greedy completions of the same prompts from two OpenAI-compatible servers, compared."""
import json, sys, urllib.request
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at", "import numpy as np\n\n# compute the mean of",
    "List of planets in the solar system:\n1.", "The best way to learn a new language is",
    "Q: What is 12 times 12?\nA:", "In 1969, humans first"]
def complete(port, prompt):
    body = {"model": MODEL[port], "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 2}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]
    lp = out["logprobs"]
    if "content" in lp:  # llama.cpp server: the chat form
        return [c["token"] for c in lp["content"]], [{t["token"]: round(t["logprob"], 3) for t in c["top_logprobs"]} for c in lp["content"]]
    return lp["tokens"], [{k: round(v, 3) for k, v in d.items()} for d in lp["top_logprobs"]]
if __name__ == "__main__":
    a_port, b_port = int(sys.argv[1]), int(sys.argv[2])
    MODEL = {a_port: sys.argv[3], b_port: sys.argv[4]}
    agree = 0
    for p in PROMPTS:
        ta, la = complete(a_port, p); tb, lb = complete(b_port, p)
        n = min(len(ta), len(tb), 32)
        div = next((i for i in range(n) if ta[i] != tb[i]), None)
        if div is None and len(ta) >= 32 and len(tb) >= 32 or div is None and ta == tb:
            agree += 1; print(f"agree  {p!r}")
        else:
            i = div if div is not None else n
            print(f"differ at {i} {p!r}: A {ta[i:i+1]} {la[i] if i < len(la) else ''} | B {tb[i:i+1]} {lb[i] if i < len(lb) else ''}")
    print(f"{agree} of {len(PROMPTS)} agree for 32 tokens")
