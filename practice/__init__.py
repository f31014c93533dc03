"""Exercises and their judge: `python practice/judge.py 129`, or `from practice.judge import grade`."""
