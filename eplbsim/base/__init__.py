"""The shared ground every other package stands on.

Holds the errors (`InputError`), files read and written so that no input is lost, the size
limits, progress bars, registry lookup, compiled loops (numba on first use, explicit vector
lanes, the passes over routing ids that traces, dispatch and ranks share), attributes patched
for a block, how a message names an option (`options`: a keyword from Python, a flag from
the command line), and the old module paths (`moved`). Takes in and gives out plain values, arrays
and tensors. Imports nothing of eplbsim.
"""
