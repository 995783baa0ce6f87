"""A calculator for a policy to call (grpo_tools_vllm.py's environment): the value of an arithmetic expression, read by
a small parser, never by Python's eval. A tool an environment uses, beside the scripts as a researcher's helper
module would be; when to call it, what the policy reads back and the reward are the script's."""

import fractions
import re


def calculate(expression):
    """The value of an arithmetic expression (integers and decimals, + - * /, parentheses, unary minus) as text, or None
    if it is not one: a recursive-descent parser over exact fractions, never Python's eval. At most 64 characters and
    10 digits a number, so that a value stays small."""
    tokens = re.findall(r"[0-9]+(?:\.[0-9]+)?|\S", expression) + ["end"]  # ("end" is no one-character token)
    if len(tokens) == 1 or len(expression) > 64 or any(len(t) > 10 for t in tokens):
        return None
    at = [0]

    def take(*wanted):
        if tokens[at[0]] in wanted:
            at[0] += 1
            return tokens[at[0] - 1]

    def atom():
        if take("-"):
            return -atom()
        if take("("):
            value = total()
            if not take(")"):
                raise ValueError("an unclosed parenthesis")
            return value
        if tokens[at[0]][0] not in "0123456789":
            raise ValueError("a number was expected")
        at[0] += 1
        return fractions.Fraction(tokens[at[0] - 1])

    def product():
        value = atom()
        while operator := take("*", "/"):
            value = value * atom() if operator == "*" else value / atom()
        return value

    def total():
        value = product()
        while operator := take("+", "-"):
            value = value + product() if operator == "+" else value - product()
        return value

    try:
        value = total()
    except (ValueError, ZeroDivisionError):
        return None
    if tokens[at[0]] != "end":
        return None
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"

