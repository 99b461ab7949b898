"""The labs: hands-on tabs that run the real engine on the real default model and say what was measured, one
module per lab (its tab's text, controls, handlers and wiring), beside the parts they share: `panels` (the lab
layout, the sampling labs' controls and waiting status), `durations` (how long this server's runs took) and
`last_run` (the session's last Playground run, which some labs read).

Each lab's `build_tab` lays out its tab and wires its events, called from `ui.build_demo` inside its `gr.Tabs()`;
the handlers are plain functions (generators for the long runs) so tests can call them directly. Long runs share
the `model-runs` queue with the Playground and Race, and stop cooperatively like them. The statistics live in
engine.tools.exactness, the figures in visuals.lab_figures. No lab imports another lab.
"""
