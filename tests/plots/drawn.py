"""What a reader sees of a figure's text, measured: the texts it draws, the pairs closer than
`GAP_PT`, and those that leave the canvas (helpers of the tests in tests/plots/)."""

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from eplbsim import plots

GAP_PT = 2  # the least space between two texts, in points


def shown_texts(fig):
    """Every text `fig` draws: titles, axis labels, legend entries, notes, and the tick labels
    in view (an axis also holds labels for ticks beyond its limits, which are not drawn)."""
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


def _boxes(fig):
    renderer = fig.canvas.get_renderer()
    with plots.paper_style():  # the ticks an axis places depend on the style's font sizes
        return [(t.get_text(), t.get_window_extent(renderer)) for t in shown_texts(fig)]


def overlapping_texts(fig):
    """The pairs of `fig`'s texts closer than `GAP_PT` (the figure has more than 5 texts);
    `fig` drawn already."""
    gap = GAP_PT * fig.dpi / 72
    boxes = _boxes(fig)
    assert len(boxes) > 5
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:]
            if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > -gap
            and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > -gap]


def texts_off_the_canvas(fig):
    """The texts of `fig` (drawn already) that reach past its edges by more than a pixel."""
    canvas = fig.bbox
    return [text for text, box in _boxes(fig)
            if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1
            or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1]


def drawer(request, figures, dpi):
    """`get(name)`: the figure `figures[name]` draws (given pytest's fixture getter) in the
    paper style, rendered at `dpi`; drawn once a module."""
    drawn = {}

    def get(name):
        if name not in drawn:
            with plots.paper_style():
                fig = figures[name](request.getfixturevalue)
                fig.set_dpi(dpi)
                FigureCanvasAgg(fig).draw()
            drawn[name] = fig
        return drawn[name]
    return get
