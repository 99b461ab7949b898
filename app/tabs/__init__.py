"""The page's main tabs, one module each: playground, workshop (a guided class), step_through, race, and api.

Each tab module has `layout(...)` (its components, built inside its gr.Tab; returns them by name)
and `wire(...)` (its events, attached once every tab exists, since the Playground's run also
updates the Step-through's source); `api.register()` adds the endpoint. The handlers are plain
functions so tests can call them.
"""
