"""The HTTP application on top of h11_server: routes, admission and the request's life up to the engine thread.

app.py (dispatch, auth, CORS, health, metrics) builds one Preparer (preparer.py: the checks and the work a request
needs before it queues) and the route tables of openai.py, ollama.py and responses.py over it; generation.py runs
a prepared request from admission to its last byte; worker.py is the engine thread; images.py turns image parts
into the engine's images; offload.py runs CPU work off the event loop; loop_lag.py measures the loop's lateness.
"""
