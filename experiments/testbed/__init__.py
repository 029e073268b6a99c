"""The testbed's training code as a package: data, objective, model surgery, clock, export
(issue 39 part 4); `experiments/train_testbed.py` is its command-line entry point."""
