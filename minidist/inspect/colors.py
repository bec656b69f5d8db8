"""Text a reader can read on the colour under it: black or white, whichever contrasts more.

Contrast is WCAG 2's: (L1 + 0.05) / (L2 + 0.05) of the two colours' relative luminances L (sRGB
channels linearised, weighted 0.2126 R + 0.7152 G + 0.0722 B). The better of black and white is at
least 4.58:1 on any colour, above WCAG's 4.5:1 for small text. Colours are "#rrggbb", "black" or
"white" (what the timelines use); nothing here imports matplotlib.
"""
from __future__ import annotations

NAMED = {"black": "#000000", "white": "#ffffff"}


def rgb(color: str) -> tuple[float, float, float]:
    """``color`` ("#rrggbb", "black" or "white") as red, green, blue in 0..1."""
    hex_ = NAMED.get(color, color)
    if len(hex_) != 7 or hex_[0] != "#":
        raise ValueError(f"a colour is '#rrggbb', 'black' or 'white', got {color!r}")
    return tuple(int(hex_[i:i + 2], 16) / 255 for i in (1, 3, 5))


def luminance(color: str) -> float:
    """WCAG 2's relative luminance of ``color``: 0 for black, 1 for white."""
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb(color))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG 2's contrast ratio of colours ``a`` and ``b``: 1 (the same) to 21 (black on white)."""
    la, lb = sorted((luminance(a), luminance(b)))
    return (lb + 0.05) / (la + 0.05)


def text_color(background: str) -> str:
    """"black" or "white": the one that contrasts more with ``background``."""
    return "black" if contrast("black", background) >= contrast("white", background) else "white"


def tint(color: str, amount: float) -> str:
    """``color`` mixed with white, ``amount`` of the way (0: itself, 1: white), as "#rrggbb"."""
    return "#" + "".join(f"{round(255 * (c + (1 - c) * amount)):02x}" for c in rgb(color))
