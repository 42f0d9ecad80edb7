"""The tool agent's demonstrations: a program that copies the board from the prompt and solves it,
as the tool role is asked to (plan-path: BFS; Sudoku: backtracking; Sokoban: BFS over player and
boxes), printing the answer in the form the env reads (`Moves: [...]`, `Solution: [[...]]`).
Each finds the answer `masenvs.demos`' solver gives (the same search, in the same move order),
which the demonstrations check on the env's own run of the program."""

from __future__ import annotations

PLAN_PATH = """\
from collections import deque

grid = BOARD
rows, cols = len(grid), len(grid[0])
start = next((r, c) for r in range(rows) for c in range(cols) if grid[r][c] == "A")
goal = next((r, c) for r in range(rows) for c in range(cols) if grid[r][c] == "G")
steps = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}

# breadth-first search from G: every free cell's distance to it
dist, queue = {goal: 0}, deque([goal])
while queue:
    r, c = queue.popleft()
    for dr, dc in steps.values():
        nr, nc = r + dr, c + dc
        if 0 <= nr < rows and 0 <= nc < cols and grid[nr][nc] != "#" and (nr, nc) not in dist:
            dist[nr, nc] = dist[r, c] + 1
            queue.append((nr, nc))

# walk from A, always to a neighbour one step closer to G
pos, moves = start, []
while pos != goal:
    for move, (dr, dc) in steps.items():
        nxt = (pos[0] + dr, pos[1] + dc)
        if dist.get(nxt) == dist[pos] - 1:
            moves.append(move)
            pos = nxt
            break
print("Moves: [" + ", ".join(moves) + "]")
"""

SUDOKU = """\
board = BOARD
n = len(board)
b = int(n**0.5)


def candidates(r, c):
    used = set(board[r]) | {board[i][c] for i in range(n)}
    top, left = r // b * b, c // b * b
    used |= {board[i][j] for i in range(top, top + b) for j in range(left, left + b)}
    return [d for d in range(1, n + 1) if d not in used]


def solve():
    # backtracking, always on the empty cell with the fewest candidates
    empty = [(len(candidates(r, c)), r, c) for r in range(n) for c in range(n) if not board[r][c]]
    if not empty:
        return True
    _, r, c = min(empty)
    for d in candidates(r, c):
        board[r][c] = d
        if solve():
            return True
    board[r][c] = 0
    return False


solve()
print("Solution:", board)
"""

SOKOBAN = """\
from collections import deque

level = BOARD
cells = {(r, c): ch for r, row in enumerate(level) for c, ch in enumerate(row)}
goals = frozenset(p for p, ch in cells.items() if ch in ".*+")
boxes = frozenset(p for p, ch in cells.items() if ch in "$*")
player = next(p for p, ch in cells.items() if ch in "@+")
steps = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


def floor(p):
    return cells.get(p, "#") != "#"


# breadth-first search over (player, boxes); walking into a box pushes it
start = (player, boxes)
parent, queue, found = {start: None}, deque([start]), None
while queue and found is None:
    state = queue.popleft()
    player, boxes = state
    for move, (dr, dc) in steps.items():
        nxt = (player[0] + dr, player[1] + dc)
        if not floor(nxt):
            continue
        moved = boxes
        if nxt in boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if not floor(beyond) or beyond in boxes:
                continue
            moved = (boxes - {nxt}) | {beyond}
        child = (nxt, moved)
        if child in parent:
            continue
        parent[child] = (state, move)
        if moved == goals:
            found = child
            break
        queue.append(child)

moves = []
while parent[found] is not None:
    found, move = parent[found]
    moves.append(move)
print("Moves: [" + ", ".join(reversed(moves)) + "]")
"""

PROGRAMS = {"plan_path": PLAN_PATH, "sudoku": SUDOKU, "sokoban": SOKOBAN}
PRINTS = {"plan_path": "Moves:", "sudoku": "Solution:", "sokoban": "Moves:"}  # before the answer


def program_reply(env_name: str, board: list) -> str:
    """The tool's reply: the env's program with `board` (as the prompt shows it) written in."""
    return "```python\n" + PROGRAMS[env_name].replace("BOARD", repr(board), 1) + "```"
