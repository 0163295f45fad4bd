"""Figures drawn once a test module, in the paper style (a helper of the tests in tests/plots/)."""

from matplotlib.backends.backend_agg import FigureCanvasAgg

from eplbsim import plots


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
