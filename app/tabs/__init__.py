"""The page's main tabs, one module each, and the API (`api`: the endpoints programs and MCP clients call);
`run_panels` holds the Playground's model and launch-command panels.

Each tab module has `layout(...)` (its components, built inside its gr.Tab; returns them by name)
and `wire(...)` (its events, attached once every tab exists, since the Playground's run also
updates the Step-through's source); `api.register()` adds the endpoints. The handlers are plain
functions so tests can call them.
"""
