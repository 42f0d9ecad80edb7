"""Our own small set of programming problems: stdin and call-based, each with a reference
solution, public examples and hidden tests. Used by the `code` env's default source.

Expected outputs were written by hand and are checked against the reference solutions by
tests/test_code_env.py.
"""

from __future__ import annotations

from masenvs.tasks.records import CodeTask, TestCase


def _stdin(
    id: str,
    prompt: str,
    solution: str,
    public: list[tuple[str, str]],
    hidden: list[tuple[str, str]],
) -> CodeTask:
    return CodeTask(
        id=f"builtin/{id}",
        prompt=prompt.strip(),
        tests=tuple(TestCase(i, o) for i, o in hidden),
        public_tests=tuple(TestCase(i, o) for i, o in public),
        reference_solution=solution.strip() + "\n",
        source="builtin",
    )


def _call(
    id: str,
    prompt: str,
    fn_name: str,
    starter: str,
    solution: str,
    public: list[tuple[list, object]],
    hidden: list[tuple[list, object]],
) -> CodeTask:
    return CodeTask(
        id=f"builtin/{id}",
        prompt=prompt.strip(),
        tests=tuple(TestCase(i, o) for i, o in hidden),
        public_tests=tuple(TestCase(i, o) for i, o in public),
        fn_name=fn_name,
        starter_code=starter.strip() + "\n",
        reference_solution=solution.strip() + "\n",
        source="builtin",
    )


PROBLEMS: tuple[CodeTask, ...] = (
    _stdin(
        "sum-of-numbers",
        """
The first line holds an integer n (1 <= n <= 1000). The second line holds n integers
between -10^9 and 10^9. Print their sum.
""",
        """
n = int(input())
print(sum(map(int, input().split()[:n])))
""",
        public=[("3\n1 2 3\n", "6\n")],
        hidden=[
            ("1\n5\n", "5\n"),
            ("4\n-1 -2 -3 -4\n", "-10\n"),
            ("3\n1000000000 1000000000 1000000000\n", "3000000000\n"),
            ("5\n0 0 0 0 7\n", "7\n"),
            ("2\n-5 5\n", "0\n"),
        ],
    ),
    _stdin(
        "reverse-words",
        """
Read one line of words separated by single spaces and print the words in reverse order,
separated by single spaces.
""",
        """
print(" ".join(reversed(input().split())))
""",
        public=[("hello world\n", "world hello\n")],
        hidden=[
            ("one\n", "one\n"),
            ("a b c d\n", "d c b a\n"),
            ("the quick brown fox\n", "fox brown quick the\n"),
            ("x y\n", "y x\n"),
        ],
    ),
    _stdin(
        "fizzbuzz",
        """
Read an integer n (1 <= n <= 100). For each i from 1 to n print one line: "FizzBuzz" if i
is divisible by 15, "Fizz" if by 3, "Buzz" if by 5, and i otherwise.
""",
        """
n = int(input())
for i in range(1, n + 1):
    print("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else i)
""",
        public=[("3\n", "1\n2\nFizz\n")],
        hidden=[
            ("1\n", "1\n"),
            ("5\n", "1\n2\nFizz\n4\nBuzz\n"),
            ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n"),
            ("6\n", "1\n2\nFizz\n4\nBuzz\nFizz\n"),
        ],
    ),
    _stdin(
        "max-subarray",
        """
The first line holds n (1 <= n <= 10^5); the second n integers. Print the largest sum of a
non-empty contiguous subarray.
""",
        """
n = int(input())
best, cur = None, 0
for x in map(int, input().split()[:n]):
    cur = max(x, cur + x)
    best = cur if best is None else max(best, cur)
print(best)
""",
        public=[("5\n1 -2 3 4 -1\n", "7\n")],
        hidden=[
            ("1\n-5\n", "-5\n"),
            ("3\n-3 -1 -2\n", "-1\n"),
            ("9\n-2 1 -3 4 -1 2 1 -5 4\n", "6\n"),
            ("4\n2 2 2 2\n", "8\n"),
            ("6\n5 -10 3 3 -1 2\n", "7\n"),
        ],
    ),
    _stdin(
        "count-primes",
        """
Read an integer n (0 <= n <= 10^6) and print how many primes are less than or equal to n.
""",
        """
n = int(input())
if n < 2:
    print(0)
else:
    sieve = bytearray([1]) * (n + 1)
    sieve[0] = sieve[1] = 0
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n + 1, i)))
    print(sum(sieve))
""",
        public=[("10\n", "4\n")],
        hidden=[
            ("0\n", "0\n"),
            ("2\n", "1\n"),
            ("100\n", "25\n"),
            ("1000\n", "168\n"),
            ("1000000\n", "78498\n"),
        ],
    ),
    _stdin(
        "balanced-brackets",
        """
The first line holds t, the number of strings. Each of the next t lines holds a string of
the characters ()[]{}. For each print YES if its brackets are balanced and NO otherwise.
""",
        """
t = int(input())
pairs = {")": "(", "]": "[", "}": "{"}
for _ in range(t):
    stack, ok = [], True
    for ch in input().strip():
        if ch in "([{":
            stack.append(ch)
        elif not stack or stack.pop() != pairs[ch]:
            ok = False
            break
    print("YES" if ok and not stack else "NO")
""",
        public=[("2\n()[]\n(]\n", "YES\nNO\n")],
        hidden=[
            ("1\n{[()()]}\n", "YES\n"),
            ("3\n((\n))\n()\n", "NO\nNO\nYES\n"),
            ("2\n([)]\n{}{}{}\n", "NO\nYES\n"),
            ("1\n]\n", "NO\n"),
        ],
    ),
    _stdin(
        "grid-shortest-path",
        """
The first line holds r and c (1 <= r, c <= 50). The next r lines each hold c characters:
'.' free, '#' wall, 'S' start, 'E' end (exactly one each). Moving up, down, left or right
through free cells, print the fewest moves from S to E, or -1 if E cannot be reached.
""",
        """
from collections import deque
r, c = map(int, input().split())
g = [input() for _ in range(r)]
start = next((i, j) for i in range(r) for j in range(c) if g[i][j] == "S")
dist = {start: 0}
queue = deque([start])
answer = -1
while queue:
    i, j = queue.popleft()
    if g[i][j] == "E":
        answer = dist[(i, j)]
        break
    for a, b in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
        if 0 <= a < r and 0 <= b < c and g[a][b] != "#" and (a, b) not in dist:
            dist[(a, b)] = dist[(i, j)] + 1
            queue.append((a, b))
print(answer)
""",
        public=[("2 3\nS.#\n#.E\n", "3\n")],
        hidden=[
            ("1 2\nSE\n", "1\n"),
            ("3 3\nS#E\n.#.\n...\n", "6\n"),
            ("2 2\nS#\n#E\n", "-1\n"),
            ("3 4\nS...\n.##.\n...E\n", "5\n"),
        ],
    ),
    _stdin(
        "word-frequency",
        """
Read lines of lowercase words until end of input. Print each distinct word with its count,
one "word count" per line, most frequent first and ties in alphabetical order.
""",
        """
import sys
from collections import Counter
counts = Counter(sys.stdin.read().split())
for word, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
    print(word, n)
""",
        public=[("b a\na\n", "a 2\nb 1\n")],
        hidden=[
            ("x\n", "x 1\n"),
            ("the cat the dog\nthe end\n", "the 3\ncat 1\ndog 1\nend 1\n"),
            ("b b a a c\n", "a 2\nb 2\nc 1\n"),
        ],
    ),
    _call(
        "two-sum",
        """
Given a list of integers `nums` and an integer `target`, return the indices [i, j] (i < j)
of the two numbers that add up to `target`. Exactly one such pair exists.
""",
        "two_sum",
        "def two_sum(nums, target):",
        """
def two_sum(nums, target):
    seen = {}
    for j, x in enumerate(nums):
        if target - x in seen:
            return [seen[target - x], j]
        seen[x] = j
""",
        public=[([[2, 7, 11, 15], 9], [0, 1])],
        hidden=[
            ([[3, 2, 4], 6], [1, 2]),
            ([[3, 3], 6], [0, 1]),
            ([[-1, -2, -3, -4, -5], -8], [2, 4]),
            ([[0, 4, 3, 0], 0], [0, 3]),
        ],
    ),
    _call(
        "is-palindrome",
        """
Return True if the string `s` reads the same forwards and backwards after removing every
character that is not a letter or digit and ignoring case, and False otherwise.
""",
        "is_palindrome",
        "def is_palindrome(s):",
        """
def is_palindrome(s):
    t = [ch.lower() for ch in s if ch.isalnum()]
    return t == t[::-1]
""",
        public=[(["A man, a plan, a canal: Panama"], True)],
        hidden=[
            (["race a car"], False),
            ([""], True),
            (["0P"], False),
            (["No 'x' in Nixon"], True),
        ],
    ),
    _call(
        "merge-intervals",
        """
Given a list of intervals [start, end], merge all overlapping (or touching) intervals and
return the merged list sorted by start.
""",
        "merge_intervals",
        "def merge_intervals(intervals):",
        """
def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
""",
        public=[([[[1, 3], [2, 6], [8, 10]]], [[1, 6], [8, 10]])],
        hidden=[
            ([[[1, 4], [4, 5]]], [[1, 5]]),
            ([[[5, 6]]], [[5, 6]]),
            ([[[8, 9], [1, 2], [2, 3]]], [[1, 3], [8, 9]]),
            ([[]], []),
        ],
    ),
    _call(
        "mean-and-spread",
        """
Given a non-empty list of numbers, return [mean, standard deviation] where the standard
deviation is the population one (divide by n). Answers within 1e-6 are accepted.
""",
        "mean_and_spread",
        "def mean_and_spread(xs):",
        """
def mean_and_spread(xs):
    mean = sum(xs) / len(xs)
    return [mean, (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5]
""",
        public=[([[1, 2, 3, 4]], [2.5, 1.118033988749895])],
        hidden=[
            ([[5]], [5.0, 0.0]),
            ([[2, 4, 4, 4, 5, 5, 7, 9]], [5.0, 2.0]),
            ([[1, 1, 2]], [1.3333333333333333, 0.4714045207910317]),
        ],
    ),
    _call(
        "longest-common-prefix",
        """
Return the longest string that is a prefix of every string in the list `words` ("" if
there is none).
""",
        "longest_common_prefix",
        "def longest_common_prefix(words):",
        """
def longest_common_prefix(words):
    if not words:
        return ""
    prefix = words[0]
    for w in words[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
""",
        public=[([["flower", "flow", "flight"]], "fl")],
        hidden=[
            ([["dog", "racecar", "car"]], ""),
            ([["same", "same"]], "same"),
            ([["a"]], "a"),
            ([["interview", "internet", "interval"]], "inter"),
        ],
    ),
    _call(
        "climb-stairs",
        """
You climb a staircase of n steps (1 <= n <= 80), taking 1 or 2 steps at a time. Return the
number of distinct ways to reach the top. Complete the method of the `Solution` class.
""",
        "climbStairs",
        "class Solution:\n    def climbStairs(self, n: int) -> int:",
        """
class Solution:
    def climbStairs(self, n: int) -> int:
        a, b = 1, 1
        for _ in range(n):
            a, b = b, a + b
        return a
""",
        public=[([2], 2), ([3], 3)],
        hidden=[([1], 1), ([5], 8), ([10], 89), ([45], 1836311903), ([80], 37889062373143906)],
    ),
    _call(
        "top-k-frequent",
        """
Return the k most frequent elements of `nums`, most frequent first; ties go to the smaller
number. The tests use type hints from `typing` (List) in the starter code.
""",
        "topKFrequent",
        "class Solution:\n    def topKFrequent(self, nums: List[int], k: int) -> List[int]:",
        """
from collections import Counter

class Solution:
    def topKFrequent(self, nums: List[int], k: int) -> List[int]:
        counts = Counter(nums)
        return sorted(counts, key=lambda x: (-counts[x], x))[:k]
""",
        public=[([[1, 1, 1, 2, 2, 3], 2], [1, 2])],
        hidden=[
            ([[1], 1], [1]),
            ([[4, 4, 5, 5, 6], 2], [4, 5]),
            ([[7, 7, 8, 8, 8, 9, 9, 9], 3], [8, 9, 7]),
        ],
    ),
)
