"""Hyper-parameter search's pure parts, read beside lesson 19: the space (space.py), the samplers
(samplers.py: random, and Bayesian optimization with the Gaussian process of gp.py and the expected
improvement of acquisition.py), early stopping by ASHA's rungs (asha.py) and the search's state
(state.py). NumPy only: nothing here sends, trains or imports the trainer; train/search.py runs them."""
