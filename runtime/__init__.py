"""The layer every process role stands on: process start-up (logging, dying with the
supervisor), the supervisor link (ready + heartbeats), shutdown signals, and reading a model
directory's files. Roles import it; it imports only ``ipc`` below it, never a role or ``procs``.
"""
