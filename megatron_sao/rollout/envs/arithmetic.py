"""Arithmetic with a calculator tool: multi-turn, verifiable answer (registered as "arithmetic").

The model may call the calculator with `<tool_call>EXPR</tool_call>`; the observation is
`<tool_response>VALUE</tool_response>` (or an error text). It ends with `<answer>N</answer>`: reward 1.0 when N
equals the problem's value, else 0.0. A turn with neither a tool call nor an answer ends the episode (reward 0).

`examples` (0-2) puts that many worked problems into the chat before the question: the calculator called, its response,
the answer. A pretrained instruct model that has never seen this format follows it in context (SmolLM2-135M-Instruct
at temperature 1 calls the tool in about 7 of 10 episodes with two examples, in 1 of 30 with none), so RL starts from
rewards above zero without a supervised warm start (examples/smollm2_tools).
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.envs.base import Environment, Episode, StepResult, extract_tag, register

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
SYSTEM = (
    "Solve the arithmetic problem. You may call a calculator with <tool_call>expression</tool_call>. "
    "Give the final number as <answer>N</answer>."
)
# Worked problems (never made by make_prompts: two operands, none above 1000, a product and a difference).
EXAMPLES = (("12 * 34", "408"), ("531 - 78", "453"))


def calculate(expr: str, max_len: int = 200) -> float:
    """Evaluate + - * / ( ) over numbers, nothing else (no names, calls or powers). ValueError otherwise."""
    if len(expr) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from e

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](ev(node.left), right)
        raise ValueError(f"unsupported syntax in {expr!r}")

    return ev(tree)


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


def parse_number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


@dataclass
class ArithmeticEpisode(Episode):
    answer: float = 0.0
    final: float | None = None

    def step(self, action_text: str) -> StepResult:
        answer = extract_tag(action_text, "answer")
        if answer is not None:
            self.final = parse_number(answer)
            return StepResult(done=True)
        expr = extract_tag(action_text, "tool_call")
        if expr is None:
            return StepResult(done=True)
        try:
            result = format_number(calculate(expr))
        except ValueError as e:
            result = f"error: {e}"
        return StepResult(done=False, observation=f"<tool_response>{result}</tool_response>")

    def reward(self) -> float:
        self.metadata["success"] = self.final is not None and abs(self.final - self.answer) < 1e-6
        return 1.0 if self.metadata["success"] else 0.0


@register
class ArithmeticEnv(Environment):
    name = "arithmetic"

    def __init__(self, max_operand: int = 20, num_ops: int = 2, examples: int = 0) -> None:
        if not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"rollout.env.options.examples={examples}: the arithmetic environment has "
                             f"{len(EXAMPLES)} worked examples; give 0 to {len(EXAMPLES)}")  # fmt: skip
        self.max_operand, self.num_ops, self.examples = max_operand, num_ops, examples

    def worked_examples(self) -> list[dict[str, str]]:
        """The chat of `examples` worked problems, as the agent loop would have played them."""
        chat: list[dict[str, str]] = []
        for expr, value in EXAMPLES[: self.examples]:
            chat += [{"role": "user", "content": f"Compute {expr}."},
                     {"role": "assistant", "content": f"<tool_call>{expr}</tool_call>"},
                     {"role": "tool", "content": f"<tool_response>{value}</tool_response>"},
                     {"role": "assistant", "content": f"<answer>{value}</answer>"}]  # fmt: skip
        return chat

    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            expr = str(rng.randint(1, self.max_operand))
            for _ in range(self.num_ops):
                expr = f"({expr} {rng.choice('+-*')} {rng.randint(1, self.max_operand)})"
            expr = expr[1:-1] if expr.startswith("(") else expr
            out.append({"id": f"arith-{seed}-{i}", "question": f"Compute {expr}.", "answer": calculate(expr)})
        return out

    def start(self, prompt: dict[str, Any]) -> ArithmeticEpisode:
        messages = prompt.get("messages") or [
            {"role": "system", "content": SYSTEM},
            *self.worked_examples(),
            {"role": "user", "content": prompt["question"]},
        ]
        return ArithmeticEpisode(messages=messages, metadata={"env": self.name}, answer=float(prompt["answer"]))
