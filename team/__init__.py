"""The team's client (team/example_model.py); scripts/roll.py swaps this folder for a candidate."""
