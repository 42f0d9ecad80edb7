"""The published MetaAgent-X harness: the auto_mas env's `harness: published`.

What the authors' harness shows a model, and which designs it runs, where it differs from
ours (docs/auto-mas.md, "Two harnesses"). The texts a model reads are theirs, verbatim:
the released designer and executor were trained on them. Each is cited as file:line of
pettingllms-ai/PettingLLMs at a054fb1 (MIT license), paths under
pettingllms/multi_agent_env/autoevol/. The behaviour is written here from that code:
- the designer prompt (`DESIGNER_SYSTEM`, `designer_user`);
- design extraction (`extract_design`), a fence inside a prompt string included;
- the script patches the harness applies before it runs a design (`patch_script`): only
  `workflow = Workflow(...)` gets the LLM client, so an AgentGraph, a ConditionalWorkflow,
  a LoopWorkflow or a workflow under another name fails as it fails there;
- an AgentNode's system prompt, its input, its loop (every reply's ```python block runs,
  then a forced final call) and the tool output's wording (`agent_loop`, `observation`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from masenvs.mas.llm import LLM

PUBLISHED = "published"

# gen_agent.py:123-124 (MASGenerator.update_from_env)
DESIGNER_SYSTEM = "You are an expert Python developer specializing in multi-agent workflow systems."
DESIGNER_USER = "Design Multi Agent System for the Question: "

# workflow/nodes/agent_node.py:20-32, appended to every AgentNode's system prompt
DELIVERY_MATH = (
    "\n\nAfter solving, output two things:\n"
    "1. Wrap the key reasoning steps you want to share with the next agent "
    "in <delivery>...</delivery> tags.\n"
    "2. State your final answer as: FINAL ANSWER: \\boxed{your_answer}"
)
DELIVERY_CODE = (
    "\n\nAfter solving, output two things:\n"
    "1. Wrap the key reasoning steps you want to share with the next agent "
    "in <delivery>...</delivery> tags.\n"
    "2. Wrap your complete solution code in <solution>...</solution> tags. "
    "Only include the final runnable code inside <solution>, no explanations."
)
# agent_node.py:326-347: what a node reads once earlier agents have answered
ORIGINAL = "**Original Question:**\n{}\n"
PREVIOUS = "**Previous Agents' Analysis:**\n"
YOUR_TURN = "Based on the original question and the analysis above, provide your own solution."
# agent_node.py:519-527: the forced final call
FINAL_MATH = "Please provide your final answer now without using any tools."
FINAL_CODE = (
    "Stop calling tools and produce your final response now. "
    "If your role is to provide the solution code, wrap it in "
    "<solution>...</solution> tags."
)
# agent_node.py:455-499: a <tool_call> that cannot be run
EMPTY_CALL = (
    "Error: Empty tool call. Please provide a valid tool call with proper JSON format, "
    "or provide your final answer without using tools."
)
NO_NAME = (
    "Error: Tool call is missing the 'name' field. Please provide a valid tool call in the "
    'format: <tool_call>{"name": "tool_name", "parameters": {...}}</tool_call>'
)
BAD_JSON = (
    "Error: Invalid JSON format in tool call. Please ensure your tool call uses valid JSON "
    'format: <tool_call>{{"name": "tool_name", "parameters": {{...}}}}</tool_call>\n'
    "JSON error: {}"
)


def designer_user(problem: str) -> str:
    return DESIGNER_USER + problem


def is_code_task() -> bool:
    return os.environ.get("TASK_TYPE", "math").lower() == "code"


# --- the designer's reply -> the design (gen_agent.py:130-168, 65-104) ------------------------


def _blocks(text: str, opener: str) -> list[str]:
    """Each `opener ... ```` block's body, stripped, left to right, as
    `re.findall(opener + r"\\s*(.*?)\\s*```", text, re.DOTALL)` finds them (with `find`:
    model output is adversarial input)."""
    out, pos = [], 0
    while (start := text.find(opener, pos)) >= 0:
        body = start + len(opener)
        end = text.find("```", body)
        if end < 0:
            break
        out.append(text[body:end].strip())
        pos = end + 3
    return out


def extract_design(text: str) -> str | None:
    """The design as the published harness reads it: inside the first `<code>...</code>`,
    its first ```python block, else its first ``` block, else the whole body (so a fence
    inside a prompt string is kept); without tags the last ```python block, then the last
    ``` block, then raw `from workflow import` code."""
    code = ""
    start = text.find("<code>")
    end = text.find("</code>", start + 6) if start >= 0 else -1
    if end >= 0:
        body = text[start + 6 : end].strip()
        code = next(iter(_blocks(body, "```python") or _blocks(body, "```")), body)
    for opener in ("```python", "```"):
        if not code:
            code = next(reversed(_blocks(text, opener)), "")
    return code or _unfenced(text) or None


_AFTERTHOUGHTS = (
    "\nWait,",
    "\nBut ",
    "\nHowever,",
    "\nAlternatively,",
    "\nSo ",
    "\nThe workflow",
    "\nThis workflow",
)


def _unfenced(text: str) -> str:
    """Raw workflow code from its first import to the first afterthought after
    `workflow.run` (gen_agent.py:65-104)."""
    found = [
        i
        for i in (text.find("from workflow import"), text.find(f"from {_LONG}.workflow import"))
        if i >= 0
    ]
    if not found:
        return ""
    candidate = text[min(found) :].strip()
    if "workflow = Workflow" not in candidate or "workflow.run" not in candidate:
        return ""
    run = candidate.find("workflow.run")
    stops = [i for i in (candidate.find(m, run) for m in _AFTERTHOUGHTS) if i > run]
    if stops:
        candidate = candidate[: min(stops)].rstrip()
    lines = candidate.splitlines()
    while lines and lines[-1].strip() in {"```", "</code>"}:
        lines.pop()
    return "\n".join(lines).strip()


_LONG = "pettingllms.multi_agent_env.autoevol"


# --- the script the harness runs (gen_agent.py:216-280, 504-598) -------------------------------

_LATEX = re.compile(
    r"\\u[0-9a-fA-F]|\\U[0-9a-fA-F]|\\N\{|\\x[0-9a-fA-F]|\\textit|\\textbf|\\underline|"
    r"\\overline|\\sqrt|\\frac|\\geq|\\leq|\\neq|\\sum|\\prod|\\int|\\lim|\\left|\\right|"
    r"\\begin|\\end"
)
_TRIPLE = re.compile(r'(\w+)(\s*=\s*)(r|R)?("""|\'\'\')(.+?)\4', re.DOTALL)
_INIT = re.compile(r"(workflow\s*=\s*Workflow\s*\([^)]*)\)", re.MULTILINE | re.DOTALL)


def patch_script(source: str) -> str:
    """The design as the harness runs it: triple-quoted strings with LaTeX made raw
    (gen_agent.py:504-557), and the client passed to `workflow = Workflow(...)` only, then
    `ai_client.workflow = workflow` (gen_agent.py:559-598). Runs inside the design's
    sandbox: a slow pattern on a hostile design spends that design's time alone."""

    def raw(m: re.Match[str]) -> str:
        if (m[3] or "").lower() == "r" or "\\" not in m[5] or not _LATEX.search(m[5]):
            return m[0]
        return f"{m[1]}{m[2]}r{m[4]}{m[5]}{m[4]}"

    def client(m: re.Match[str]) -> str:
        joint = "" if m[1].rstrip().endswith(",") else ","
        return f"{m[1]}{joint}\n    ai_client=ai_client\n)\nai_client.workflow = workflow"

    return _INIT.sub(client, _TRIPLE.sub(raw, source))


class HarnessClient:
    """The `ai_client` the harness defines before a design (gen_agent.py:247-259): only what a
    node reads of it. Every call goes through the design's gate to the executor."""

    def __init__(self) -> None:
        self.workflow: Any = None

    def chat(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the harness client is not called: nodes call the executor")


# --- an AgentNode (workflow/nodes/agent_node.py) ---------------------------------------------


def system_prompt(designed: str) -> str:
    """The designer's system prompt plus the delivery instruction (agent_node.py:291-292)."""
    return (designed or "") + (DELIVERY_CODE if is_code_task() else DELIVERY_MATH)


def delivery(text: str) -> str | None:
    """What an agent shares (agent_node.py:44-67): its `<delivery>`, else the rest of its first
    `FINAL ANSWER:` line, else its `<solution>` block, tags kept."""
    start = text.find("<delivery>")
    end = text.find("</delivery>", start) if start >= 0 else -1
    if end >= 0:
        return text[start + len("<delivery>") : end].strip()
    at = text.find("FINAL ANSWER:")
    if at >= 0:  # r"FINAL ANSWER:\s*(.*)": blank lines skipped, then one line
        return text[at + len("FINAL ANSWER:") :].lstrip().split("\n", 1)[0].strip()
    start = text.find("<solution>")
    end = text.find("</solution>", start) if start >= 0 else -1
    if end >= 0:
        return text[start : end + len("</solution>")].strip()
    return None


def user_turn(question: str, earlier: list[tuple[str, str]]) -> str:
    """The original question, then each earlier agent's (name, reply) as it is shared
    (agent_node.py:310-355)."""
    if not earlier:
        return question
    parts = [ORIGINAL.format(question), PREVIOUS]
    for sender, reply in earlier:
        summary = delivery(reply)
        if not summary:  # an empty share counts as none, as there
            summary = reply
            if len(reply) > 1200:
                summary = f"{reply[:200]}\n...(reasoning omitted)...\n{reply[-800:]}"
        parts.append(f"[{sender}]:\n{summary}\n")
    parts.append(YOUR_TURN)
    return "\n".join(parts)


def python_block(reply: str) -> str | None:
    """The first ```python block's code (agent_node.py:368-377): a newline after the tag,
    closed; an unclosed block is no code."""
    pos = 0
    while (start := reply.find("```python", pos)) >= 0:
        after = start + len("```python")
        gap = len(reply[after:]) - len(reply[after:].lstrip())
        newline = reply.rfind("\n", after, after + gap)
        if newline >= 0:
            end = reply.find("```", newline + 1)
            return None if end < 0 else reply[newline + 1 : end].strip()
        pos = after
    return None


async def agent_loop(
    name: str, messages: list[dict[str, str]], tools: Any, max_turns: int, llm: LLM
) -> str:
    """An AgentNode's calls (agent_node.py:384-536): up to max_turns + 1 calls, where a reply
    with a ```python block is always run (an answer in it too) and one with a <tool_call>
    calls that tool; the first reply with neither is the answer. Out of turns: one more
    call, told to answer."""
    talk = [dict(m) for m in messages]
    for _ in range(max_turns + 1):
        reply = await llm.chat(name, talk)
        code = python_block(reply)
        if code is not None:
            result = await _run_code(code, tools, llm)
        elif "<tool_call>" in reply and "</tool_call>" in reply:
            result = _call_tool(reply, tools)
        else:
            return reply
        talk += [{"role": "assistant", "content": reply}, {"role": "user", "content": result}]
    talk.append({"role": "user", "content": FINAL_CODE if is_code_task() else FINAL_MATH})
    return await llm.chat(name, talk)


async def _run_code(code: str, tools: Any, llm: LLM) -> str:
    """The registry's `python_execute` when the design registered one, else the Python tool
    (agent_node.py:421-438)."""
    tool = tools.get_tool("python_execute")
    try:
        if tool is not None and not getattr(tool["function"], "masenvs_sandboxed_python", False):
            return str(tools.call_tool("python_execute", {"code": code}))
        return await llm.execute_python(code)
    except Exception as exc:  # the tool's failure is the agent's observation
        return f"Error executing code: {type(exc).__name__}: {exc}"


def _call_tool(reply: str, tools: Any) -> str:
    """One `<tool_call>{json}</tool_call>` (agent_node.py:443-505)."""
    text = reply.split("<tool_call>")[1].split("</tool_call>")[0].strip()
    if not text:
        return EMPTY_CALL
    try:
        call = json.loads(text)
        name = call.get("name")
        params = call.get("parameters") or call.get("arguments") or {}
        if not name:
            return NO_NAME
        return f"Tool '{name}' returned: {tools.call_tool(name, params)}"
    except (ValueError, RecursionError) as exc:
        return BAD_JSON.format(exc)
    except Exception as exc:
        return f"Error executing tool: {exc}"


def observation(fields: dict[str, Any], seconds: float) -> str:
    """A run of the Python tool as the published MathEnvironment words it (math_env.py:91-104);
    `fields`: the run's verdict, stdout, stderr and exit code."""
    verdict, stdout = fields.get("verdict"), str(fields.get("stdout") or "").strip()
    if verdict == "ok":
        if stdout:
            return f"Code executed successfully.\nOutput: {stdout}"
        return "Code executed successfully. No output produced."
    if verdict == "timeout":
        return f"Error: Code execution timed out after {seconds:g} seconds"
    error = str(fields.get("stderr") or "").strip() or "Unknown error"
    code = fields.get("returncode")
    return f"Error executing code (exit code {1 if code is None else code}):\n{error}"


# --- what one node reads of another (agent_node.py:75-220) ------------------------------------


def _deliverable(text: str) -> tuple[str | None, int]:
    """The final deliverable and where it starts: the last `\\boxed{}` (math) or the last
    `<solution>`, `<code>`, ```python or ``` block (code) (agent_node.py:85-128)."""
    if is_code_task():
        for pattern, wrap in (
            (r"<solution>\s*(.*?)\s*</solution>", "<solution>\n{}\n</solution>"),
            (r"<code>\s*(.*?)\s*</code>", "<code>\n{}\n</code>"),
            (r"```python\s*(.*?)```", "```python\n{}\n```"),
            (r"```\s*(.*?)```", "```\n{}\n```"),
        ):
            found = list(re.finditer(pattern, text, re.DOTALL))
            if found and found[-1].group(1).strip():
                return wrap.format(found[-1].group(1).strip()), found[-1].start()
        return None, -1
    at = text.rfind("\\boxed{")
    if at < 0:
        return None, -1
    depth, i = 1, at + len("\\boxed{")
    while i < len(text) and depth > 0:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return ("\\boxed{" + text[at + 7 : i - 1] + "}", at) if depth == 0 else (None, -1)


def compact_response(text: str) -> str:
    """A reply over 10,000 characters cut to its `<delivery>` and deliverable, else the
    reasoning before the deliverable, else its tail; at most 3,000 characters
    (agent_node.py:149-203)."""
    text = (text or "").strip()
    if len(text) <= 10000:
        return text
    shared = delivery(text)
    if shared and shared.startswith(("\\boxed{", "<solution>")):
        shared = None
    deliverable, at = _deliverable(text)
    if shared and deliverable:
        compact = f"{shared}\n\n{deliverable}"
    elif shared:
        compact = shared
    elif deliverable:
        start = max(0, at - 800)
        prefix = "...[earlier reasoning omitted]...\n" if start > 0 else ""
        compact = (prefix + text[start:at].strip() + "\n" + deliverable).strip()
    else:
        compact = "...[earlier content omitted]...\n" + text[-4000:] if len(text) > 4000 else text
    if len(compact) > 3000:
        compact = compact[:1500] + "\n...[truncated]...\n" + compact[-1500:]
    return compact.strip()


def compact_critique(text: str) -> str:
    """A critique over 1,500 characters: its head and tail (agent_node.py:206-218)."""
    text = (text or "").strip()
    if len(text) <= 1500:
        return text
    return text[:500] + "\n...[truncated critique]...\n" + text[-1000:]


# --- ReflectionNode, EnsembleNode, DebateNode (their nodes/*.py) ---------------------------

# reflection_node.py:82-111
REFLECTION = (
    "You are a critical reviewer. Analyze the following response to a question.\n\n"
    "Original question: {question}\n\n"
    "Response to review:\n{response}\n\n"
    "Provide a thorough critique:\n"
    "1. Identify any errors, inaccuracies, or logical flaws\n"
    "2. Check if the response is complete and addresses all aspects of the question\n"
    "3. Evaluate the clarity and structure of the response\n"
    "4. Suggest specific improvements\n\n"
    "Be constructive but rigorous in your critique."
)
REFINEMENT = (
    "Original question: {question}\n\n"
    "Your previous response:\n{response}\n\n"
    "Critique from reviewer:\n{reflection}\n\n"
    "Based on this critique, provide an improved response that addresses all the issues raised."
)
REFINEMENT_WITH_HISTORY = (
    "Original question: {question}\n\n"
    "=== Iteration History ===\n{history}\n\n"
    "=== Current Iteration ===\n"
    "Your latest response:\n{response}\n\n"
    "Latest critique:\n{reflection}\n\n"
    "Based on ALL previous feedback, provide a significantly improved response."
)


def reflection_history(history: list[dict[str, Any]]) -> str:
    """Earlier iterations as a refinement reads them (reflection_node.py:113-137)."""
    if not history:
        return "No previous iterations."
    lines = []
    for record in history:
        lines.append(f"--- Iteration {record.get('iteration', 0)} ---")
        lines.append(f"Response: {compact_response(record.get('response', ''))}")
        critique = compact_critique(record.get("reflection") or "")
        if critique:
            lines.append(f"Critique: {critique}")
        lines.append("")
    return "\n".join(lines)


def consensus_prompt(question: str, named: list[tuple[str, str]]) -> str:
    """What the ensemble's judge reads when the vote splits (ensemble_node.py:313-341)."""
    listing = "\n\n".join(
        f"--- Solution {i + 1} ({name}) ---\n{compact_response(reply)}"
        for i, (name, reply) in enumerate(named)
    )
    form = (
        "Your final solution MUST be wrapped in <solution>...</solution> tags, "
        "containing the complete runnable Python code (stdin in, stdout out)."
        if is_code_task()
        else "Your final answer MUST be in \\boxed{} format."
    )
    return (
        f"**Original Question:**\n{question}\n\n**Multiple Solutions:**\n\n{listing}\n\n"
        "Review each solution carefully. Check the reasoning and calculations. "
        f"Select the best answer or synthesize a corrected answer. {form}"
    )


def debate_round(question: str, names: list[str], history: list[list[str]]) -> str:
    """A debater's prompt from the second round on (debate_node.py:46-63, 100-106)."""
    text = "Previous debate rounds:\n\n"
    for i, replies in enumerate(history):
        text += f"=== Round {i + 1} ===\n"
        for j, reply in enumerate(replies):
            text += f"Agent {j + 1} ({names[j]}):\n{compact_response(reply)}\n\n"
    return (
        f"Original question: {question}\n\n{text}\n"
        "Based on the discussion above, please provide your refined answer. "
        "You may critique other responses and improve your own."
    )


def debate_judge(question: str, rounds: int, names: list[str], replies: list[str]) -> str:
    """The judge's prompt after the last round (debate_node.py:146-159)."""
    listing = "\n\n".join(
        f"Response {i + 1} from {names[i]}:\n{compact_response(r)}" for i, r in enumerate(replies)
    )
    return (
        f"Original question: {question}\n\n"
        f"After {rounds} rounds of debate, here are the final responses:\n\n{listing}\n\n"
        "Please select the best response or synthesize a better answer based on the debate. "
        "Provide your final answer."
    )
