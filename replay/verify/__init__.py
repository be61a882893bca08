"""Verification: the replay timeline, the verdict rules and the reports. Runs in: frontend process."""
