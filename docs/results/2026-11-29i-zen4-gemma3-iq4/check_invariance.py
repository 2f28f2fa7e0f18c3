import sys
from pathlib import Path
sys.path.insert(0, "/work/main")
from tests.e2e import test_gemma3 as T

def main():
    path = Path(sys.argv[1])
    engine = T._engine(path)
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in [*T.PROMPTS, T.LONG]]
    T.test_same_request_same_answer_across_the_window(path, engine, prompts)
    print("same request, same answer: alone / concurrent / cached / chunked: OK on", path.name)

if __name__ == "__main__":
    main()
