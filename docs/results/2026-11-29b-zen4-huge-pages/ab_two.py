"""What ab_arena.py and ab_parts.py share: two engines of one model in one process, a 34-step
decode each at 976-1010 tokens of context (a request on a cached 976-token prompt), alternated
round by round with the order flipped every round; each round's step p50s and their ratio,
then the medians."""
import statistics, time
from engine import SamplingParams


def alternate(engines, rounds):
    """`engines`: two (LLMEngine, name) pairs, in load order."""
    vocab = engines[0][0].vocab_size
    prompt = [(i * 7919) % (vocab - 100) + 100 for i in range(976)]
    res = {name: [] for _, name in engines}

    def run(eng, name, r):
        eng.add_request(f"r{r}", prompt, SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))
        eng.step(); eng.step()  # prefill (cached prefix) and a first decode
        steps = []
        while eng.has_unfinished_requests():
            t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
        res[name].append(statistics.median(steps) * 1e3)

    (a, an), (b, bn) = engines
    for r in range(rounds):
        for eng, name in [(a, an), (b, bn)][:: 1 if r % 2 else -1]:
            run(eng, name, r)
        print(f"round {r}: {an} {res[an][-1]:.2f} {bn} {res[bn][-1]:.2f} ratio {res[bn][-1]/res[an][-1]:.3f}", flush=True)
    ratios = [y / x for x, y in zip(res[an], res[bn])]
    print(f"median {an} {statistics.median(res[an]):.2f}, {bn} {statistics.median(res[bn]):.2f}, median ratio {bn}/{an} {statistics.median(ratios):.3f}")
