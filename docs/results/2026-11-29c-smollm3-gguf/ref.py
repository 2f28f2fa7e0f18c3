import sys, json, urllib.request, torch
sys.path.insert(0, "/work/main")
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
from agree import PROMPTS
def first(port, p):
    body = {"model": model, "prompt": tok.encode(p), "max_tokens": 1, "temperature": 0, "logprobs": 3}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    lp = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["logprobs"]
    if "content" in lp:
        return {t["token"]: t["logprob"] for t in lp["content"][0]["top_logprobs"]}
    return lp["top_logprobs"][0]
errs = []
for p in PROMPTS:
    ids = tok.encode(p)
    with torch.no_grad():
        r = ref(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    got = first(port, p)
    top = r.topk(50)
    text = {tok.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices)}
    e = max((abs(v - text[k]) for k, v in got.items() if k in text), default=float('nan'))
    errs.append(e)
print(port, " ".join(f"{e:.3f}" for e in errs), f"mean {sum(errs)/len(errs):.3f}")
