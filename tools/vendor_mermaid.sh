#!/usr/bin/env bash
# Refresh docs/javascripts/mermaid.min.js: the site serves mermaid itself, so its diagrams draw
# offline (mkdocs-material loads mermaid from a CDN only when no `mermaid` is defined).
# Usage: tools/vendor_mermaid.sh [VERSION]   (default: the version below; needs npm)
# Keep the major version mkdocs-material expects (its bundle names mermaid@11).
set -euo pipefail
version="${1:-11.17.2}"
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mermaid@$version" >/dev/null && tar xzf mermaid-*.tgz)
cp "$work/package/dist/mermaid.min.js" "$root/docs/javascripts/mermaid.min.js"
cp "$work/package/LICENSE" "$root/docs/javascripts/mermaid.LICENSE"
echo "docs/javascripts/mermaid.min.js is mermaid $version"
