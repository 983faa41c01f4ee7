// Starts Swagger UI on /docs (service/routes/ops.py) from a file: the content-security policy allows no
// inline script. The assets come from the swagger-ui-bundle package, served by this server.
"use strict";
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
