import sys, time
sys.path.insert(0, "/work/main")
def rss(tag):
    d = {}
    for l in open("/proc/self/status"):
        if l.startswith(("VmRSS", "VmHWM", "RssAnon")): d[l.split(":")[0]] = int(l.split()[1]) // 1024
    print(f"{tag:30s} {d}", flush=True)
rss("python")
import torch; rss("torch")
import engine; from engine import EngineConfig, LLMEngine; rss("engine import")
import engine.loading.setup as setup
orig_tok = setup.load_tokenizer
def tok(p):
    t = orig_tok(p); rss("tokenizer loaded"); return t
setup.load_tokenizer = tok
orig_q = setup._quantized_model
def q(*a, **k):
    m = orig_q(*a, **k); rss("quantized model"); return m
setup._quantized_model = q
orig_pool = setup._make_pool
def pool(*a, **k):
    p = orig_pool(*a, **k); rss("pool"); return p
setup._make_pool = pool
cfg = EngineConfig(model=sys.argv[1], kv_cache_memory=128 << 20, chat_template=sys.argv[2] if len(sys.argv) > 2 else None)
eng = LLMEngine(cfg); rss("LLMEngine")
from engine import SamplingParams
from tests.e2e.conftest import run_requests
ids = eng.tokenizer.encode("Tell me about the sea")
run_requests(eng, [("a", ids, SamplingParams(max_tokens=40), 0)]); rss("one request")
import ctypes; ctypes.CDLL("libc.so.6").malloc_trim(0); rss("trim")
