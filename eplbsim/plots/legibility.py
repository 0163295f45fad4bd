"""Whether a figure's text can be read, measured rather than trusted to the eye: the texts it
draws, pairs closer than `GAP_PT`, texts that reach past the canvas (`illegible`).

A text's box is its extent on the canvas once the figure is laid out and drawn, in the paper
style (`paper_style`), the style eplbsim's figures are drawn and saved in: how many ticks an
axis places depends on the style's font sizes.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.text import Text

from .style import paper_style

GAP_PT = 2.0  # the least space between two texts, in points


def shown_texts(fig: Figure) -> list[Text]:
    """Every text `fig` draws, non-blank and visible: titles, axis labels, legend entries, notes,
    and the tick labels in view (an axis also holds labels for ticks beyond its limits, which
    are not drawn)."""
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in axis.majorTicks + axis.minorTicks for t in (tick.label1, tick.label2)}
    shown = [t for ax in fig.axes if ax.get_visible()
             for i, axis in enumerate((ax.xaxis, ax.yaxis)) if axis.get_visible()
             for t in axis.get_ticklabels()
             if min(axis.get_view_interval()) <= t.get_position()[i]
             <= max(axis.get_view_interval())]
    others = [t for t in fig.findobj(Text) if id(t) not in ticks]
    return [t for t in others + shown if t.get_visible() and t.get_text().strip()
            and (t.axes is None or t.axes.get_visible())]


def illegible(fig: Figure) -> list[str]:
    """What keeps `fig`'s text from being read, one line a problem, none for a legible figure:
    `'quota' overlaps 'lp-golden'` for two texts (tick labels, value labels, titles, legend
    entries, notes) whose boxes come closer than `GAP_PT` points, and `'policy' leaves the
    figure` for a text reaching more than a pixel past the canvas (clipped when saved whole).

    `fig` is laid out and drawn first, in the paper style (`paper_style`), at its own dpi;
    nothing is written. A notebook or script asserts ``not illegible(fig)`` beside each figure
    it shows or saves.
    """
    with paper_style():  # the ticks an axis places depend on the style's font sizes
        fig.draw_without_rendering()
        boxes = [(t.get_text(), t.get_window_extent()) for t in shown_texts(fig)]
    gap = GAP_PT * fig.dpi / 72  # pixels
    canvas = fig.bbox
    problems = [f"{a!r} overlaps {b!r}" for i, (a, box_a) in enumerate(boxes)
                for b, box_b in boxes[i + 1:]
                if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > -gap
                and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > -gap]
    return problems + [f"{text!r} leaves the figure" for text, box in boxes
                       if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1
                       or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1]
