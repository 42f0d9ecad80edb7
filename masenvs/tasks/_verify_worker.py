"""math-verify in a child process: one JSON request per line on stdin, one reply per line.

math-verify's own timeout uses SIGALRM, which only works on the main thread, so the parent
calls it with timeouts off and bounds each request itself by killing this process. The
memory cap keeps sympy from taking the machine down on answers like 9^{9^{9^9}}.
"""

import json
import logging
import resource
import sys
from functools import lru_cache

MEMORY_BYTES = 2 << 30


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    logging.disable(logging.WARNING)  # math-verify warns that its timeout is off: intended
    from math_verify import parse, verify

    @lru_cache(maxsize=4096)
    def parsed(text: str) -> tuple:
        # Answers are LaTeX fragments ("\frac{1}{2}") or plain text ("1/2", "x = 3"): math
        # mode first, then math-verify's plain-expression extraction.
        for candidate in (f"${text}$", text):
            result = parse(candidate, parsing_timeout=None)
            if result:
                return tuple(result)
        return ()

    for line in sys.stdin:
        request = json.loads(line)
        try:
            gold, pred = parsed(request["gold"]), parsed(request["pred"])
            ok = bool(gold and pred) and verify(list(gold), list(pred), timeout_seconds=None)
            if not ok and request.get("symmetric") and gold and pred:
                ok = verify(list(pred), list(gold), timeout_seconds=None)
        except Exception:  # a MemoryError or a sympy failure on one answer: not equal
            ok = False
        sys.stdout.write(json.dumps({"ok": bool(ok)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
