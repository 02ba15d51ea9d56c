"""Generate the Components pages at build time (mkdocs-gen-files): one page per kind, each
component with its plugin, description, reported metrics and options, read from the registries
as `eblvm plugins --kind KIND` prints them."""

from __future__ import annotations

import mkdocs_gen_files

from eblvm_core.config import describe
from eblvm_core.plugins import load

TITLES = {
    "models": "Models",
    "posteriors": "Posteriors",
    "generators": "Generators",
    "objectives": "Score-matching objectives",
    "divergences": "Lower-level divergences",
    "estimators": "Estimators",
    "datasets": "Datasets",
    "evaluators": "Evaluators",
    "samplers": "Samplers",
    "loggers": "Loggers",
    "optimizers": "Optimizers",
    "schedules": "Learning-rate schedules",
    "launchers": "Launchers",
    "spec_readers": "Spec readers",
}


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


loaded = load(warn=False)
owner = {(k, n): info.name for info in loaded.plugins for k, names in info.components.items() for n in names}
kinds = [kind for kind in TITLES if loaded.registries.get(kind) and loaded[kind].names()]
with mkdocs_gen_files.open("components/index.md", "w") as index:
    index.write(
        "# Components\n\nWhat the installed plugins register, one page per kind, generated from the registries "
        "(the same as `eblvm plugins --kind KIND`). A recipe names a component by its `kind`; its options are the "
        "other keys of its section.\n\n"
    )
    for kind in kinds:
        index.write(f"- [{TITLES[kind]}]({kind}.md): {', '.join(f'`{n}`' for n in sorted(loaded[kind].names()))}\n")
for kind in kinds:
    with mkdocs_gen_files.open(f"components/{kind}.md", "w") as page:
        page.write(f"# {TITLES[kind]}\n\n`eblvm plugins --kind {kind}` prints this page's content.\n\n")
        for name in sorted(loaded[kind].names()):
            entry = loaded[kind].get(name)
            page.write(f"## `{name}`\n\n{entry.doc}\n\nPlugin: `{owner.get((kind, name), '?')}`.")
            keys = entry.reported_keys()
            if keys:
                page.write(f" Reports: {', '.join(f'`{key}`' for key in keys)}.")
            page.write("\n\n")
            fields = describe(entry.config)
            if fields:
                page.write("| option | type | default | meaning |\n|---|---|---|---|\n")
                for field, tp, default, help_ in fields:
                    page.write(f"| `{field}` | `{cell(tp)}` | `{cell(default)}` | {cell(help_)} |\n")
                page.write("\n")
