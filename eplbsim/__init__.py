"""eplbsim."""
