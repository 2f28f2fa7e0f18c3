"""Does building llguidance's tokenizer release the GIL? Main thread counts Python loop
iterations while a thread builds it."""
import sys, time, threading
sys.path.insert(0, ".")  # run from the repository root
from engine.loading.source import resolve_model
from engine.loading.source import load_tokenizer
import llguidance
src = resolve_model(None)
tok = load_tokenizer(src.path)
backend = tok.backend_tokenizer
s = backend.to_str()
def build():
    t = time.perf_counter()
    llguidance.LLTokenizer(s, n_vocab=49152, eos_token=[2])
    print("build alone", round(time.perf_counter() - t, 3))
build()
done = threading.Event()
def bg():
    build(); done.set()
def count(seconds):
    n = 0; t = time.perf_counter()
    while time.perf_counter() - t < seconds: n += 1
    return n
base = count(0.3)
th = threading.Thread(target=bg); th.start()
n = count(0.3)
th.join()
print("loop iterations in 0.3 s alone", base, "while building", n)
