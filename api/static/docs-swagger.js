// Starts Swagger UI on /schema/swagger (api/docs_pages.py), from a file of
// ours rather than an inline script, so the page's CSP can refuse every
// inline script. validatorUrl null: Swagger UI would otherwise ask a
// public validator about the document.
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.specUrl,
    dom_id: "#swagger-ui",
    validatorUrl: null,
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
    layout: "StandaloneLayout",
  });
});
