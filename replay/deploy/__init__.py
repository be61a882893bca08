"""Routing requests over the miniature's engines, P to D. Runs in: frontend process.

placement (which P and D take a request), pd_flow (each request's way, sans IO),
pd_router (that flow over engine clients), topology (launching the engine cores).
"""
