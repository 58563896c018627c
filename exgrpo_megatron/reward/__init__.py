"""Rewards: pure Math-Verify scoring (``scoring``) and the killable grading process pool (``grader``:
``GraderPool``, ``score_response``, ``validate_timeout``). The prompt templates are data (data/templates.py).

Kept import-free so that importing one module does not pull in Math-Verify/sympy.
"""
