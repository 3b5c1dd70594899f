"""Sans-I/O protocol layer: request parsing/validation, response and chunk building, SSE framing, errors.

Nothing here touches sockets, threads or trio; every function maps values to values (or bytes) so the wire
format is tested byte-for-byte without a server. appliance/h11_server.py is the only caller that does I/O.
"""
